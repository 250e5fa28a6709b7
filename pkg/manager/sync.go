package manager

import (
	"reflect"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Sync makes the workers owned by the config file equal specs: new ones are
// added, changed ones replaced, dropped ones drained and removed. Workers
// registered through the API are never touched.
func (m *Manager) Sync(specs []workers.Spec) {
	want := make(map[string]workers.Spec, len(specs))
	for _, s := range specs {
		want[s.URL] = s
	}
	m.mu.Lock()
	if m.owned == nil {
		m.owned = map[string]workers.Spec{}
	}
	owned := m.owned
	m.mu.Unlock()

	for url, old := range owned {
		if _, keep := want[url]; keep {
			continue
		}
		if w, ok := m.reg.FindURL(url); ok {
			m.log.Info().Str("url", url).Msg("config: removing worker")
			m.wg.Add(1)
			go func() { defer m.wg.Done(); m.RemoveNow(w) }()
		}
		_ = old
		m.mu.Lock()
		delete(m.owned, url)
		m.mu.Unlock()
	}
	for url, s := range want {
		prev, isOwned := owned[url]
		w, exists := m.reg.FindURL(url)
		switch {
		case !exists:
			if _, err := m.AddNow(s); err != nil {
				m.log.Warn().Err(err).Str("url", url).Msg("config: worker not added")
				continue
			}
			m.log.Info().Str("url", url).Msg("config: worker added")
		case isOwned && !reflect.DeepEqual(prev, s):
			if err := m.Replace(w.ID, s); err != nil {
				m.log.Warn().Err(err).Str("url", url).Msg("config: worker not updated")
				continue
			}
			m.log.Info().Str("url", url).Msg("config: worker updated")
		case !isOwned:
			// Registered by the API or the command line first; the config now owns it.
		}
		m.mu.Lock()
		m.owned[url] = s
		m.mu.Unlock()
	}
}
