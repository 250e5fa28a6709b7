//go:build race

package pairing

// raceEnabled: the race detector makes sync.Pool drop items at random, so
// allocation counts are not meaningful under -race.
const raceEnabled = true
