package sglang

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

var (
	errWaitingTimeout = errors.New("waiting timeout")
	errLostConnection = errors.New("lost connection with prefill instance")
)

// prefillInfo is the prefill's GET /route?...=-1 answer (PrefillServerInfo).
type prefillInfo struct {
	AttnTPSize               int    `json:"attn_tp_size"`
	AttnCPSize               int    `json:"attn_cp_size"`
	DPSize                   int    `json:"dp_size"`
	PPSize                   int    `json:"pp_size"`
	PageSize                 int    `json:"page_size"`
	KVCacheDtype             string `json:"kv_cache_dtype"`
	FollowBootstrapRoom      bool   `json:"follow_bootstrap_room"`
	EnableDSACacheLayerSplit bool   `json:"enable_dsa_cache_layer_split"`
	PrefillHTTPPort          int    `json:"prefill_http_port"`
}

func handshakeFailed(it *item, reason string) *apiError {
	return abortErr(500, "Decode handshake failed for request rank=0 decode_req.req.rid='%s' decode_req.req.bootstrap_room=%d with exception %s",
		it.rid, it.room, reason)
}

func transferFailed(it *item, reason string) *apiError {
	return abortErr(500, "Decode transfer failed for request rank=0 decode_req.req.rid='%s' decode_req.req.bootstrap_room=%d with exception KVTransferError(bootstrap_room=%d): %s",
		it.rid, it.room, it.room, reason)
}

// bootstrapAddr is SGLang's f"{host}:{port}" (a missing host is "None").
func bootstrapAddr(it *item) (addr, host string) {
	host = "None"
	if it.hasHost {
		host = strings.TrimSuffix(strings.TrimPrefix(it.host, "["), "]")
	}
	return net.JoinHostPort(host, strconv.Itoa(it.port)), host
}

func (s *Server) decodeItem(ctx context.Context, req *request, it *item, cfg Config) (outcome, *apiError) {
	const leg = "decode"
	room := common.RoomPtr(it.room)
	if it.healthForm {
		return localOutcome(it, req.maxTokens, "none"), nil
	}
	if it.stall {
		s.event(leg, it.rid, room, "stalled_duplicate", "lax: duplicate room waits for the waiting timeout")
		if err := common.Sleep(ctx, cfg.WaitingTimeout); err != nil {
			return outcome{}, errClientGone
		}
		s.transferFailed.Add(1)
		return outcome{}, transferFailed(it, fmt.Sprintf("Request %d timed out after %s in KVPoll.WaitingForInput", it.room, secs(cfg.WaitingTimeout)))
	}
	addr, host := bootstrapAddr(it)

	info, reason := s.fetchTopology(ctx, addr, host, cfg)
	if ctx.Err() != nil {
		s.event(leg, it.rid, room, "aborted", "client disconnected during the handshake")
		return outcome{}, errClientGone
	}
	if info == nil {
		s.bootstrapFailed.Add(1)
		s.event(leg, it.rid, room, "handshake_failed", reason)
		return outcome{}, handshakeFailed(it, reason)
	}
	if info.PageSize != cfg.PageSize {
		reason := fmt.Sprintf("RuntimeError: Page size mismatch: prefill server has page_size=%d, but decode server has page_size=%d", info.PageSize, cfg.PageSize)
		s.event(leg, it.rid, room, "handshake_failed", reason)
		return outcome{}, handshakeFailed(it, reason)
	}
	if info.KVCacheDtype != cfg.KVCacheDtype {
		reason := fmt.Sprintf("RuntimeError: KV cache dtype mismatch: prefill server has kv_cache_dtype=%s, but decode server has kv_cache_dtype=%s", info.KVCacheDtype, cfg.KVCacheDtype)
		s.event(leg, it.rid, room, "handshake_failed", reason)
		return outcome{}, handshakeFailed(it, reason)
	}

	s.dRooms.setStage(it.room, "waiting_transfer")
	res, e := s.joinAndWait(ctx, addr, it, cfg)
	if e != nil {
		return outcome{}, e
	}
	s.dRooms.markUsed(it.room)

	if res.PromptTokensHash != hashString(it.hash) || res.PromptLen != len(it.tokens) {
		detail := fmt.Sprintf("prefill prompt_tokens_hash=%s prompt_len=%d, decode prompt_tokens_hash=%s prompt_len=%d",
			res.PromptTokensHash, res.PromptLen, hashString(it.hash), len(it.tokens))
		if !cfg.Lax {
			s.event(leg, it.rid, room, "kv_mismatch", detail)
			return outcome{}, abortErr(500, "KV mismatch for room %d: %s", it.room, detail)
		}
		s.event(leg, it.rid, room, "recomputed", detail)
		return localOutcome(it, req.maxTokens, "recomputed"), nil
	}
	s.event(leg, it.rid, room, "transferred", res.PrefillRID)

	tokens := make([]common.Token, req.maxTokens)
	tokens[0] = common.Token{ID: res.FirstTokenID, Word: res.FirstTokenWord, Logprob: res.FirstTokenLogprob}
	g := common.NewGenerator(it.hash, it.sample)
	g.Next()
	for i := 1; i < len(tokens); i++ {
		tokens[i] = g.Next()
	}
	return outcome{item: it, tokens: tokens, kv: "transferred", cached: res.CachedTokens}, nil
}

// fetchTopology is the decode's GET /route?...=-1 with SGLang's retry loop.
// It returns nil and the failure reason after the last attempt.
func (s *Server) fetchTopology(ctx context.Context, addr, host string, cfg Config) (*prefillInfo, string) {
	url := "http://" + addr + "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
	for attempt := 1; attempt <= cfg.FetchAttempts; attempt++ {
		if host != "None" && host != "" {
			if info, err := s.getRoute(ctx, url); err == nil {
				return info, ""
			} else {
				s.log.Debug().Err(err).Str("addr", addr).Int("attempt", attempt).Msg("fetch prefill info")
			}
		}
		if ctx.Err() != nil {
			return nil, "client disconnected"
		}
		if attempt < cfg.FetchAttempts {
			if common.Sleep(ctx, cfg.FetchRetryInterval) != nil {
				return nil, "client disconnected"
			}
		}
	}
	return nil, fmt.Sprintf("Could not fetch prefill parallel info from %s after %d attempts", addr, cfg.FetchAttempts)
}

func (s *Server) getRoute(ctx context.Context, url string) (*prefillInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /route: %d %s", resp.StatusCode, strings.TrimSpace(string(body)))
	}
	var info prefillInfo
	if err := json.Unmarshal(body, &info); err != nil {
		return nil, fmt.Errorf("GET /route: %w", err)
	}
	return &info, nil
}

// joinAndWait posts the join and long-polls until the prefill reports the
// room transferred, with the waiting timeout and heartbeats.
func (s *Server) joinAndWait(ctx context.Context, addr string, it *item, cfg Config) (*transferResult, *apiError) {
	const leg = "decode"
	room := common.RoomPtr(it.room)
	decodeID := fmt.Sprintf("%s#%d", s.url, s.seq.Add(1))
	waitCtx, cancelWait := context.WithTimeoutCause(ctx, cfg.WaitingTimeout, errWaitingTimeout)
	defer cancelWait()
	hbCtx, cancelHB := context.WithCancelCause(waitCtx)
	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		s.heartbeat(hbCtx, addr, cfg, cancelHB)
	}()
	defer func() {
		cancelHB(nil)
		<-hbDone
	}()

	body, _ := json.Marshal(joinInfo{
		Room: it.room, DecodeID: decodeID, RID: it.rid,
		PromptTokensHash: hashString(it.hash), PromptLen: len(it.tokens),
		PageSize: cfg.PageSize, KVCacheDtype: cfg.KVCacheDtype,
	})
	req, err := http.NewRequestWithContext(hbCtx, http.MethodPost, "http://"+addr+"/_fake/join", bytes.NewReader(body))
	if err != nil {
		return nil, handshakeFailed(it, err.Error())
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.client.Do(req)
	var res transferResult
	if err == nil {
		raw, rerr := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if rerr != nil {
			err = rerr
		} else if jerr := json.Unmarshal(raw, &res); jerr != nil && resp.StatusCode == http.StatusOK {
			err = jerr
		}
	}
	if err != nil {
		cause := context.Cause(hbCtx)
		switch {
		case ctx.Err() != nil:
			s.sendAbort(ctx, addr, it.room, decodeID)
			s.event(leg, it.rid, room, "aborted", "client disconnected while waiting for the transfer")
			return nil, errClientGone
		case errors.Is(cause, errWaitingTimeout):
			s.sendAbort(ctx, addr, it.room, decodeID)
			s.transferFailed.Add(1)
			reason := fmt.Sprintf("Request %d timed out after %s in KVPoll.WaitingForInput", it.room, secs(cfg.WaitingTimeout))
			s.event(leg, it.rid, room, "waiting_timeout", reason)
			return nil, transferFailed(it, reason)
		default:
			s.sendAbort(ctx, addr, it.room, decodeID)
			s.transferFailed.Add(1)
			reason := fmt.Sprintf("Lost connection with prefill instance (bootstrap_addr: %s)", addr)
			s.event(leg, it.rid, room, "lost_connection", fmt.Sprintf("%s: %v", reason, err))
			return nil, transferFailed(it, reason)
		}
	}
	switch resp.StatusCode {
	case http.StatusOK:
		return &res, nil
	case http.StatusGone:
		s.transferFailed.Add(1)
		s.event(leg, it.rid, room, "transfer_failed", res.Message)
		return nil, transferFailed(it, res.Message)
	default:
		s.bootstrapFailed.Add(1)
		msg := res.Message
		if msg == "" {
			msg = fmt.Sprintf("join returned %d", resp.StatusCode)
		}
		s.event(leg, it.rid, room, "join_rejected", msg)
		return nil, handshakeFailed(it, msg)
	}
}

// heartbeat probes GET http://addr/health while the decode waits; after
// HeartbeatMaxFailures consecutive failures it cancels the wait.
func (s *Server) heartbeat(ctx context.Context, addr string, cfg Config, cancel context.CancelCauseFunc) {
	t := time.NewTicker(cfg.HeartbeatInterval)
	defer t.Stop()
	fails := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s.probe(ctx, "http://"+addr+"/health", max(cfg.HeartbeatInterval, 2*time.Second)) {
			fails = 0
			continue
		}
		if ctx.Err() != nil {
			return
		}
		if fails++; fails >= cfg.HeartbeatMaxFailures {
			cancel(errLostConnection)
			return
		}
	}
}

func (s *Server) probe(ctx context.Context, url string, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// sendAbort tells the prefill that this decode gave up on the room (SGLang's
// ABORT notification). Best effort, bounded to one second.
func (s *Server) sendAbort(ctx context.Context, addr string, room uint64, decodeID string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	body, _ := json.Marshal(map[string]any{"room": room, "decode_id": decodeID, "reason": "Aborted by AbortReq."})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/_fake/abort", bytes.NewReader(body))
	if err != nil {
		return
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.client.Do(req)
	if err != nil {
		return
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}
