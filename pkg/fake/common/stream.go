package common

// Event sequences shared by the fakes' streamed /v1/messages and
// /v1/responses answers.

// MessageStart opens an Anthropic /v1/messages stream: message_start with
// message, then content_block_start of an empty text block at index 0.
func (s *SSE) MessageStart(message map[string]any) error {
	if err := s.Event("message_start", map[string]any{"type": "message_start", "message": message}); err != nil {
		return err
	}
	return s.Event("content_block_start", map[string]any{"type": "content_block_start", "index": 0, "content_block": map[string]any{"type": "text", "text": ""}})
}

// MessageText writes one content_block_delta carrying text.
func (s *SSE) MessageText(text string) error {
	return s.Event("content_block_delta", map[string]any{"type": "content_block_delta", "index": 0, "delta": map[string]any{"type": "text_delta", "text": text}})
}

// MessageEnd closes an Anthropic stream: content_block_stop, message_delta
// with the stop reason, stop sequence and usage, then message_stop.
func (s *SSE) MessageEnd(stopReason, stopSequence any, usage map[string]any) error {
	if err := s.Event("content_block_stop", map[string]any{"type": "content_block_stop", "index": 0}); err != nil {
		return err
	}
	if err := s.Event("message_delta", map[string]any{"type": "message_delta", "delta": map[string]any{"stop_reason": stopReason, "stop_sequence": stopSequence}, "usage": usage}); err != nil {
		return err
	}
	return s.Event("message_stop", map[string]any{"type": "message_stop"})
}

// SequencedEvents returns a writer of OpenAI Responses stream events: each
// call sets v's "type" to name and its "sequence_number" (0, 1, …) and writes
// it as event name.
func (s *SSE) SequencedEvents() func(name string, v map[string]any) error {
	seq := 0
	return func(name string, v map[string]any) error {
		v["type"] = name
		v["sequence_number"] = seq
		seq++
		return s.Event(name, v)
	}
}
