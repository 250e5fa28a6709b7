package extproc

import (
	"sync"

	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/smg-project/smg-extproc/pkg/apierr"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

type workersT = workers.Worker

// asAPIError keeps an *apierr.Error or wraps anything else.
func asAPIError(err error, status int, code string) *apierr.Error {
	var ae *apierr.Error
	if errors.As(err, &ae) {
		return ae
	}
	return apierr.Wrap(err, status, code, err.Error())
}

// doPost sends one JSON POST and reads the whole answer.
func doPost(ctx context.Context, c *http.Client, url string, hdr http.Header, body []byte) (int, http.Header, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, nil, nil, fmt.Errorf("build request: %w", err)
	}
	req.Header = hdr
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, nil, fmt.Errorf("read response body: %w", err)
	}
	return resp.StatusCode, resp.Header, b, nil
}

// record feeds one leg's outcome to its worker's breaker and counts 5xx and
// transport failures in smg_worker_errors_total.
func (d *Deps) record(w *workers.Worker, leg string, status int, transportErr bool) {
	w.Record(status, transportErr)
	if transportErr || status >= 500 {
		et := "backend_error"
		if transportErr {
			et = "connection_error"
		} else if status == 504 {
			et = "timeout"
		}
		d.Metrics.WorkerErrors.WithLabelValues(leg, "http", et).Inc()
	}
}

// active counts one in-flight leg on w (its load and smg_worker_requests_active);
// the returned func releases it once.
func (d *Deps) active(w *workers.Worker) func() {
	release := w.Acquire()
	g := d.Metrics.WorkerActive.WithLabelValues(w.URL)
	g.Inc()
	var once sync.Once
	return func() { once.Do(func() { release(); g.Dec() }) }
}
