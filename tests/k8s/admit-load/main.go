// Command admit-load is the load generator of benchmarks/compare.py: it POSTs JSON bodies to one
// local HTTP endpoint from N workers, each on its own keep-alive connection, and prints every
// request's latency and answer. The same program times both sides (the agent's
// `--debug-admit-api` and the kubelet harness's `/admit`), so neither is charged for the other's
// client, and a Go client costs the 2-CPU machine a small fraction of what a Python one did
// (its CPU competed with the side being measured).
//
//	admit-load --url http://127.0.0.1:PORT/debug/v1/admit --workers 8 < bodies.jsonl
//	-> {"ns":[...per request...],"answers":[...raw JSON answers...],"wallNs":N}
//
// Bodies are taken one line at a time, in order, by whichever worker is free; entry i of "ns"
// and "answers" belongs to body i. A request that fails or answers other than 2xx stops the run
// (exit 1, the error on stderr); the answers' content is the caller's to judge.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

type result struct {
	Ns      []int64           `json:"ns"`
	Answers []json.RawMessage `json:"answers"`
	WallNs  int64             `json:"wallNs"`
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "admit-load: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	url := flag.String("url", "", "the endpoint to POST each body to (http://127.0.0.1:PORT/path)")
	workers := flag.Int("workers", 1, "concurrent requests, each worker on its own keep-alive connection")
	flag.Parse()
	target, err := parseURL(*url)
	if err != nil || *workers < 1 {
		fail("usage: admit-load --url http://HOST:PORT/PATH [--workers N] < bodies (one JSON body per line): %v", err)
	}

	var bodies [][]byte
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<20), 64<<20)
	for scanner.Scan() {
		if line := bytes.TrimSpace(scanner.Bytes()); len(line) > 0 {
			bodies = append(bodies, append([]byte(nil), line...))
		}
	}
	if err := scanner.Err(); err != nil {
		fail("reading bodies: %v", err)
	}

	out := result{Ns: make([]int64, len(bodies)), Answers: make([]json.RawMessage, len(bodies))}
	var next atomic.Int64
	var failed atomic.Pointer[error]
	var wg sync.WaitGroup
	started := time.Now()
	for w := 0; w < *workers; w++ {
		conn, err := net.DialTimeout("tcp", target.host, 10*time.Second)
		if err != nil {
			fail("dial %s: %v", target.host, err)
		}
		wg.Add(1)
		go func(conn net.Conn) {
			defer wg.Done()
			defer conn.Close()
			reader := bufio.NewReaderSize(conn, 64<<10)
			for failed.Load() == nil {
				i := int(next.Add(1)) - 1
				if i >= len(bodies) {
					return
				}
				request := target.request(bodies[i])
				t0 := time.Now()
				answer, err := roundTrip(conn, reader, request)
				out.Ns[i] = time.Since(t0).Nanoseconds()
				if err != nil {
					failed.CompareAndSwap(nil, &err)
					return
				}
				out.Answers[i] = answer
			}
		}(conn)
	}
	wg.Wait()
	out.WallNs = time.Since(started).Nanoseconds()
	if err := failed.Load(); err != nil {
		fail("%v", *err)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail("writing the result: %v", err)
	}
}

type endpoint struct{ host, path string }

func parseURL(raw string) (endpoint, error) {
	rest, ok := strings.CutPrefix(raw, "http://")
	if !ok {
		return endpoint{}, fmt.Errorf("only http:// URLs: %q", raw)
	}
	host, path, _ := strings.Cut(rest, "/")
	if host == "" {
		return endpoint{}, fmt.Errorf("no host in %q", raw)
	}
	return endpoint{host, "/" + path}, nil
}

// request is the whole HTTP/1.1 request, built before the clock starts.
func (e endpoint) request(body []byte) []byte {
	head := fmt.Sprintf("POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n",
		e.path, e.host, len(body))
	return append([]byte(head), body...)
}

// roundTrip writes one request and reads its answer on a keep-alive connection: the status line, the headers
// (Content-Length is required: both sides send it) and the body. A plain HTTP/1.1 client, kept minimal so the
// load generator costs little CPU next to the side it measures.
func roundTrip(conn net.Conn, reader *bufio.Reader, request []byte) ([]byte, error) {
	if _, err := conn.Write(request); err != nil {
		return nil, err
	}
	status, err := reader.ReadString('\n')
	if err != nil {
		return nil, err
	}
	fields := strings.Fields(status)
	if len(fields) < 2 || !strings.HasPrefix(fields[0], "HTTP/1.") {
		return nil, fmt.Errorf("malformed status line %q", status)
	}
	code, err := strconv.Atoi(fields[1])
	if err != nil {
		return nil, fmt.Errorf("malformed status line %q", status)
	}
	length := -1
	for {
		line, err := reader.ReadString('\n')
		if err != nil {
			return nil, err
		}
		line = strings.TrimRight(line, "\r\n")
		if line == "" {
			break
		}
		name, value, _ := strings.Cut(line, ":")
		if strings.EqualFold(strings.TrimSpace(name), "Content-Length") {
			if length, err = strconv.Atoi(strings.TrimSpace(value)); err != nil {
				return nil, fmt.Errorf("bad Content-Length %q", value)
			}
		}
	}
	if length < 0 {
		return nil, fmt.Errorf("answer without Content-Length")
	}
	body := make([]byte, length)
	if _, err := io.ReadFull(reader, body); err != nil {
		return nil, err
	}
	if code/100 != 2 {
		return nil, fmt.Errorf("HTTP %d: %s", code, body)
	}
	return body, nil
}
