package config

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Watch reloads path on every change until ctx ends. It watches the directory,
// so editors that replace the file (rename over it) are seen too. A file that
// fails to load is reported to onError and the last good one stays in force.
func Watch(ctx context.Context, path string, onChange func(*File), onError func(error)) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch config: %w", err)
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		w.Close()
		return fmt.Errorf("watch config: %w", err)
	}
	if err := w.Add(filepath.Dir(abs)); err != nil {
		w.Close()
		return fmt.Errorf("watch config dir: %w", err)
	}
	go func() {
		defer w.Close()
		var timer *time.Timer
		fire := make(chan struct{}, 1)
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				if filepath.Clean(ev.Name) != abs || ev.Op&(fsnotify.Write|fsnotify.Create|fsnotify.Rename) == 0 {
					continue
				}
				// Coalesce the burst of events one save produces.
				if timer != nil {
					timer.Stop()
				}
				timer = time.AfterFunc(150*time.Millisecond, func() {
					select {
					case fire <- struct{}{}:
					default:
					}
				})
			case <-fire:
				f, err := LoadFile(abs)
				if err != nil {
					onError(err)
					continue
				}
				onChange(f)
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				onError(fmt.Errorf("config watcher: %w", err))
			}
		}
	}()
	return nil
}
