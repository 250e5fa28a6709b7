// Command fake-engine runs strict fake inference engines for PD tests, the
// demo stack and benchmarks:
//
//	fake-engine sglang --mode prefill --http-port 31000 --bootstrap-port 8998
//	fake-engine sglang --mode decode  --http-port 31001
//	fake-engine vllm --role producer --connector nixl --http-port 8100 --side-channel-port 5600
//	fake-engine vllm --role consumer --connector nixl --http-port 8200
//
// Each engine kind is a subcommand with its own flags (fake-engine <kind> -h).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

// commands lists the engine kinds.
func commands() []command {
	return []command{
		{name: "sglang", summary: "fake SGLang worker (prefill, decode or null mode)", run: runSGLang},
		{name: "vllm", summary: "fake vLLM worker (kv role producer/consumer/both; connector nixl, mooncake, moriio or none)", run: runVLLM},
	}
}

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	usage := func(w io.Writer) {
		fmt.Fprintln(w, "usage: fake-engine <kind> [flags]")
		fmt.Fprintln(w, "kinds:")
		for _, c := range commands() {
			fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
		}
	}
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		usage(stdout)
		return 0
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, args[1:], stdout, stderr)
		switch {
		case err == nil:
			return 0
		case errors.Is(err, flag.ErrHelp):
			return 0
		case errors.Is(err, errUsage):
			return 2
		default:
			fmt.Fprintf(stderr, "fake-engine %s: %v\n", c.name, err)
			return 1
		}
	}
	fmt.Fprintf(stderr, "fake-engine: unknown kind %q\n", args[0])
	usage(stderr)
	return 2
}

// errUsage marks a flag error already reported by the flag package.
var errUsage = errors.New("usage error")
