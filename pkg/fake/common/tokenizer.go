package common

import (
	"hash/crc32"
	"math"
	"strings"
)

// VocabSize bounds every token id: id = crc32(word) % VocabSize.
const VocabSize = 50000

// Tokenize splits text on whitespace and maps every word to TokenID(word).
func Tokenize(text string) []int {
	words := strings.Fields(text)
	ids := make([]int, len(words))
	for i, w := range words {
		ids[i] = TokenID(w)
	}
	return ids
}

// TokenID is the fake tokenizer's id for one word.
func TokenID(word string) int {
	return int(crc32.ChecksumIEEE([]byte(word)) % VocabSize)
}

// HashTokens is a stable FNV-1a/64 hash of a token sequence (length mixed in).
// Two legs that saw the same prompt tokens compute the same hash.
func HashTokens(tokens []int) uint64 {
	const (
		offset = 14695981039346656037
		prime  = 1099511628211
	)
	h := uint64(offset)
	mix := func(v uint32) {
		for i := 0; i < 4; i++ {
			h ^= uint64(byte(v >> (8 * i)))
			h *= prime
		}
	}
	mix(uint32(len(tokens)))
	for _, t := range tokens {
		mix(uint32(t))
	}
	return h
}

// Token is one generated token.
type Token struct {
	ID      int     `json:"id"`
	Word    string  `json:"word"`
	Logprob float64 `json:"logprob"`
}

// Piece is the text a token contributes at output position pos: the first
// token has no leading space, later ones are preceded by one.
func (t Token) Piece(pos int) string {
	if pos == 0 {
		return t.Word
	}
	return " " + t.Word
}

// Generator emits a deterministic token sequence seeded from a prompt hash
// and a sample index, so two fakes given the same prompt produce the same
// output (PD output == non-PD output).
type Generator struct {
	state uint64
}

// NewGenerator seeds a generator from the prompt hash and the sample index
// (the j of n>1 sampling).
func NewGenerator(promptHash uint64, sample int) *Generator {
	return &Generator{state: promptHash ^ (uint64(sample+1) * 0x9E3779B97F4A7C15)}
}

// Next returns the next token.
func (g *Generator) Next() Token {
	z := splitmix(&g.state)
	w := VocabWord(int(z % vocabWords))
	return Token{ID: TokenID(w), Word: w, Logprob: logprobFrom(z >> 32)}
}

// Generate returns the first n tokens of a fresh sequence.
func Generate(promptHash uint64, sample, n int) []Token {
	g := NewGenerator(promptHash, sample)
	out := make([]Token, n)
	for i := range out {
		out[i] = g.Next()
	}
	return out
}

// PromptLogprob is the fake logprob of prompt token pos given the previous
// one. Position 0 has no logprob (nil), as in SGLang.
func PromptLogprob(tokens []int, pos int) *float64 {
	if pos <= 0 || pos >= len(tokens) {
		return nil
	}
	s := uint64(tokens[pos-1])<<32 | uint64(uint32(tokens[pos]))
	v := logprobFrom(splitmix(&s) >> 32)
	return &v
}

// Score is a deterministic value in (0, 1) derived from two token sequences,
// used for rerank scores.
func Score(a, b []int) float64 {
	s := HashTokens(a) ^ (HashTokens(b) * 31)
	z := splitmix(&s)
	return math.Round(float64(z%1_000_000)/1_000_000*1e4)/1e4 + 0.00005
}

const (
	consonants = "bcdfghjklmnprstvz"
	vowels     = "aeiou"
	syllables  = len(consonants) * len(vowels)
	vocabWords = uint64(syllables * syllables)
)

// VocabWord is the i-th word of the fake output vocabulary (two syllables).
func VocabWord(i int) string {
	i %= int(vocabWords)
	a, b := i/syllables, i%syllables
	return string([]byte{
		consonants[a/len(vowels)], vowels[a%len(vowels)],
		consonants[b/len(vowels)], vowels[b%len(vowels)],
	})
}

func splitmix(state *uint64) uint64 {
	*state += 0x9E3779B97F4A7C15
	z := *state
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

func logprobFrom(v uint64) float64 {
	return -math.Round((float64(v%10000)/10000*3+0.0001)*1e4) / 1e4
}
