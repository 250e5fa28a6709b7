package workers

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRegistryRefusesAnotherSpellingOfTheSameEndpoint(t *testing.T) {
	res := func(string) ([]string, error) { return []string{"10.0.0.1"}, nil }
	reg := NewRegistry()
	first, err := New(Spec{URL: "http://10.0.0.1:8000", Type: Decode}, res)
	require.NoError(t, err)
	require.NoError(t, reg.Add(first))
	for _, u := range []string{"10.0.0.1:8000", "http://10.0.0.1:8000/", " http://10.0.0.1:8000"} {
		w, err := New(Spec{URL: u, Type: Decode}, res)
		require.NoError(t, err, u)
		var ee *ErrExists
		assert.True(t, errors.As(reg.Add(w), &ee), "%q is the same endpoint", u)
		found, ok := reg.FindURL(u)
		assert.True(t, ok, u)
		assert.Equal(t, first.ID, found.ID)
	}
	// Another DP rank of the same engine is another worker.
	r1, err := New(Spec{URL: "http://10.0.0.1:8000@1", Type: Decode}, res)
	require.NoError(t, err)
	assert.NoError(t, reg.Add(r1))
}
