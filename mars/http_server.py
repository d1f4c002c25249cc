# HTTP/1.1 for a small JSON API on http.server, hardened so that no client stalls the others and no web
# page drives the server. An application subclasses Handler (its `routes`, `get` and `post`) and Server.
#
# What holds for every connection:
# - it delivers each whole request (line, headers, body) within `timeout`, however it trickles; the
#   same timeout bounds its writes and its idle keep-alive time;
# - at most `max_connections` are open. One more takes the place of the connection that has waited
#   longest for its request, if that is over `grace` (a slowloris, or an idle keep-alive one), so a flood
#   of slow connections cannot hold the places. Only a client that holds its request up loses its place
#   (its thread waits in recv and has not got, nor finds waiting in the socket, a whole request head): a
#   request that has arrived but that a loaded server has not read yet is answered. With none to
#   replace, it gets 503 without a connection thread: one of REFUSERS threads reads its request head
#   first, so the client reads the reply instead of a reset, or, while they are all busy, it is answered
#   at once after reading what has arrived;
# - a refusal sent before the body was read (413, 403, ...) lingers: the rest is read and dropped while
#   it keeps coming, so the client reads the reply instead of a broken pipe;
# - a thread waiting on the application sees within POLL_S that its client hung up;
# - the Host header names this server (DNS rebinding), and so does an absolute-form target
#   (GET http://name/path);
# - `100 Continue` is sent only once every check has passed, for a body that will be read;
# - a POST is application/json (a cross-origin page cannot send that without a CORS preflight, which
#   gets no CORS headers here) with one Content-Length of at most MAX_BODY;
# - with an API key, every route but /health needs "Authorization: Bearer KEY";
# - every error, for every method and path, is an OpenAI-style JSON body.
# What each check answers, and why: docs/serving.md.
from __future__ import annotations

import contextlib
import hmac
import io
import ipaddress
import json
import queue
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

MAX_BODY = 1 << 20  # bytes; a longer request body is refused without being read
POLL_S = 0.05  # how often a waiting HTTP thread checks whether its client hung up
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}  # Host header names always accepted
REFUSERS = 16  # threads that may read refused connections' request heads at once
# A refused connection's unread bytes are read and dropped until it pauses for LINGER_S, up to LINGER_BYTES
# and within the timeout: a paused clock, not a total one, so a client on a loaded machine is never cut.
LINGER_S = 1.0
LINGER_BYTES = 64 << 20


@dataclass(frozen=True)
class Limits:
    timeout: float  # seconds a connection has to send a whole request; also its idle and write timeout
    max_connections: int  # open connections (one thread each)
    allowed_hosts: frozenset[str] = frozenset()  # Host names accepted besides loopback and the bind address; * = any
    api_key: str = ""  # required as "Authorization: Bearer KEY" on all but /health; empty = none
    # At the cap, a connection whose client has held its request head up for longer than this gives its
    # place to a new one: an ordinary client sends its request within milliseconds, a slowloris never does.
    grace: float = 1.0


HEAD_END = re.compile(rb"\n\r?\n")  # the blank line that ends a request head (http.server takes a bare LF too)


class Deadline(io.RawIOBase):
    # A connection's reads. While `due` is set (the monotonic time a request must be in by), each recv
    # may wait only for the time left until it, so a silent or trickling client (slowloris, a
    # Content-Length longer than the body, a request line that never ends) cannot hold its thread past
    # it. Otherwise each waits `timeout`.
    def __init__(self, sock: socket.socket, timeout: float):
        super().__init__()
        self.sock, self.timeout = sock, timeout
        self.due: float | None = None
        self.received = 0  # bytes since `due` was set: did any of the due request arrive?
        self.head = False  # the bytes since `due` hold a whole request head
        self.tail = b""  # their last bytes, where a head's end may begin
        self.waiting = False  # its thread waits in recv: for the client, not for the CPU
        self.expired = False
        self.evicted = False  # its place went to a new connection (Server.evict): its request is not answered
        self.lock = threading.Lock()  # between lift() and evict(): a request is either answered or evicted

    def expect(self, due: float) -> None:
        # The next request must be in by `due`.
        self.due, self.received, self.head, self.tail, self.expired = due, 0, False, b"", False

    def lift(self) -> None:
        # The request is in: no deadline while it is answered.
        with self.lock:
            if self.evicted:
                raise ConnectionAbortedError("the connection gave its place to another")
            self.due = None

    def evict(self, before: float) -> bool:
        # Takes the connection's place if it has waited for its request since before `before` and the
        # client still holds the request head up.
        with self.lock:
            if self.evicted or self.due is None or self.due - self.timeout > before or not self.held_up():
                return False
            self.evicted = True
        with contextlib.suppress(OSError):  # wakes its thread's recv, which reads the end of the connection
            self.sock.shutdown(socket.SHUT_RDWR)
        return True

    def held_up(self) -> bool:
        # The client, not a loaded server, keeps the request head from being read: the thread waits in recv
        # and neither what it read nor what waits in the socket holds a whole head. A thread that is not
        # in recv has bytes to work on (a pipelined request already buffered), or has not got the CPU yet.
        if not self.waiting or self.head:
            return False
        return not HEAD_END.search(self.tail + unread(self.sock))

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        left = self.timeout if self.due is None else self.due - time.monotonic()
        if left <= 0:
            self.expired = True
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        self.waiting = True
        try:
            n = self.sock.recv_into(buf)
        except TimeoutError:
            self.expired = self.due is not None
            raise
        finally:
            self.waiting = False
            self.sock.settimeout(self.timeout)  # what writes and hung_up() expect
        self.received += n
        if not self.head:
            seen = self.tail + bytes(buf[:n])
            self.head, self.tail = HEAD_END.search(seen) is not None, seen[-2:]
        return n


def unread(sock: socket.socket, size: int = 1 << 16) -> bytes:
    # What waits in the socket, left there for its own thread, without blocking. The look goes through a
    # copy of the descriptor: the socket's own recv would first wait for data, up to its timeout. (The
    # copy shares the file's non-blocking flag, which the socket's timeout has already set.)
    try:
        with socket.fromfd(sock.fileno(), sock.family, sock.type) as copy:
            copy.settimeout(0.0)
            return copy.recv(size, socket.MSG_PEEK)
    except OSError:  # nothing waits (BlockingIOError), or the connection has closed
        return b""


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a hung client never blocks shutdown
    request_queue_size = 128  # listen backlog; the default 5 drops bursts of connects (a 1 s SYN retry)

    def __init__(self, host: str, port: int, handler: type[Handler], limits: Limits, quiet: bool):
        self.limits, self.quiet = limits, quiet
        self.connections: dict[socket.socket, Deadline] = {}  # open client connections and their readers
        self.lock = threading.Lock()  # over `connections`: added here, removed by connection threads
        self.refusers = threading.BoundedSemaphore(REFUSERS)
        # DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 still sends
        # "Host: evil.example". Only this server's own names are accepted.
        wildcard = host in ("", "0.0.0.0", "::")
        self.hosts = LOOPBACK_NAMES | {h.lower() for h in limits.allowed_hosts} | (set() if wildcard else {host})
        super().__init__((host, port), handler)

    def process_request(self, request, client_address) -> None:
        if len(self.connections) >= self.limits.max_connections and not self.evict():
            if self.refusers.acquire(blocking=False):  # refused without a connection thread
                threading.Thread(target=self.refuse_busy, args=(request, LINGER_S), daemon=True).start()
            else:  # a flood: what has arrived is read, nothing is waited for
                self.refuse_busy(request, 0.0, release=False)
            return
        with self.lock:
            self.connections[request] = Deadline(request, self.limits.timeout)
        super().process_request(request, client_address)

    def evict(self) -> bool:
        # The place of the connection that has waited longest for its request, over `grace`; False if none has.
        with self.lock:
            waiting = sorted((r for r in self.connections.values() if r.due is not None), key=lambda r: r.due)
        before = time.monotonic() - self.limits.grace
        for reader in waiting:
            if reader.evict(before):
                # Its place is free now, not when its thread has read the end of the connection: until then
                # it would still count against the cap, and the next connection would evict a second one.
                with self.lock:
                    self.connections.pop(reader.sock, None)
                return True
        return False

    def refuse_busy(self, sock: socket.socket, wait: float, release: bool = True) -> None:
        # 503 to a connection over the cap, after reading its request head (until it pauses for `wait`
        # seconds): a socket closed with unread bytes is reset, and the client would see that, not the reply.
        cap = self.limits.max_connections
        body = json.dumps(error_body(f"too many open connections (--max-connections {cap}); retry later",
                                     "server_error")).encode()
        head = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        due = time.monotonic() + self.limits.timeout
        try:
            drain(sock, wait, due, 1 << 16, until=b"\r\n\r\n")
            sock.settimeout(1.0)
            sock.sendall(head + body)
            sock.shutdown(socket.SHUT_WR)
            drain(sock, wait, due, LINGER_BYTES)
        except OSError:
            pass
        finally:
            sock.close()
            if release:
                self.refusers.release()

    def shutdown_request(self, request) -> None:
        with self.lock:
            self.connections.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client hanging up is no server error
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        with self.lock:
            open_now = list(self.connections)
        for conn in open_now:  # wakes the threads waiting on idle keep-alive connections
            with contextlib.suppress(OSError):  # it may have closed meanwhile
                conn.shutdown(socket.SHUT_RDWR)


def drain(sock: socket.socket, idle: float, due: float, limit: int, until: bytes = b"") -> None:
    # Reads and drops what the peer sends until it pauses for `idle` seconds (0: what has arrived), its
    # end of file, `limit` bytes or `until`, or the monotonic time `due`.
    seen = b""
    while limit > 0:
        sock.settimeout(max(min(idle, due - time.monotonic()), 0.0))
        try:
            chunk = sock.recv(min(limit, 1 << 16))
        except (BlockingIOError, TimeoutError):
            return
        if not chunk:
            return
        limit -= len(chunk)
        if until:
            seen = seen[-len(until):] + chunk
            if until in seen:
                return


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def host_name(header: str) -> str:
    # A Host header, "name:port", "[v6]:port" or "name", -> the lower-case name.
    name = header[1:].split("]")[0] if header.startswith("[") else header.rsplit(":", 1)[0] if header.count(
        ":") == 1 else header
    return name.lower().rstrip(".")


def exposure_warning(host: str, api_key: str) -> str | None:
    # A loopback bind is reachable from this machine only; anything else, without a key, from the network.
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        loopback = False
    if loopback or api_key:
        return None
    return (f"warning: --host {host or '(all interfaces)'} is reachable from other machines and there is no "
            "API key: anyone who can connect can use this server. Pass --api-key KEY (or set MARS_API_KEY), "
            "or bind to 127.0.0.1 behind a proxy that authenticates.")


class Handler(BaseHTTPRequestHandler):
    # One thread per connection. A subclass sets `routes` and answers admitted requests in get() and
    # post(); by then the request has passed every check above and its deadline is lifted.
    protocol_version = "HTTP/1.1"  # keep-alive; every reply has a Content-Length except streams
    default_request_version = "HTTP/1.1"  # so that even a reply to a broken request line has a status line
    disable_nagle_algorithm = True  # a stream's small chunks go out at once, not after a delayed ACK
    routes: dict[str, str] = {}  # path -> its one method
    next_look = 0.0  # when wait() next looks at the socket for a hang-up (time.monotonic)
    server: Server

    def get(self, path: str) -> None:
        raise NotImplementedError

    def post(self, path: str, body: bytes) -> None:
        raise NotImplementedError

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by a reader with a deadline (closing it releases its socket reference)
        self.reader = self.server.connections[self.connection]
        self.rfile = io.BufferedReader(self.reader)
        self.connection.settimeout(self.server.limits.timeout)  # writes: a client that stops reading is dropped

    def handle_one_request(self) -> None:
        # The next request, line to body, must arrive within the timeout. A silent keep-alive connection
        # is closed quietly at the deadline; one that sent part of a request gets 408 first.
        timeout = self.server.limits.timeout
        self.reader.expect(time.monotonic() + timeout)
        self.command, self.requestline, self.request_version = None, "", self.default_request_version
        super().handle_one_request()  # http.server catches the TimeoutError and closes the connection
        if self.reader.expired:
            self.close_connection = True
            if self.reader.received:
                with contextlib.suppress(OSError):
                    self.send_error_json(408, f"the request did not arrive within {timeout:g} s",
                                         "invalid_request_error", code="request_timeout")

    def parse_request(self) -> bool:
        if self.reader.evicted:  # what it sent before its place went to another is not answered
            self.close_connection = True
            return False
        if len(self.raw_requestline.split()) == 2:  # HTTP/0.9: no headers, no status line; we speak 1.1
            self.send_error(400, "the request line needs an HTTP version: METHOD PATH HTTP/1.1")
            return False
        return super().parse_request()

    def log_message(self, format: str, *args) -> None:
        if not self.server.quiet:
            super().log_message(format, *args)

    def send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":  # a reply to HEAD has the headers of the reply to GET, and no body
            self.wfile.write(data)

    def send_error_json(self, status: int, message: str, kind: str, param: str | None = None,
                        code: str | None = None, headers: dict | None = None) -> None:
        self.send_json(status, error_body(message, kind, param, code), headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own errors (a bad request line or header, an unknown method) as JSON, not HTML.
        self.close_connection = True
        self.send_error_json(code, message or HTTPStatus(code).phrase, "invalid_request_error")

    def refuse(self, status: int, message: str, code: str, headers: dict | None = None) -> None:
        # An error sent before the body was read: the connection cannot carry another request. What is
        # still on its way is read and dropped for a moment (bounded), so the client gets to read this.
        self.close_connection = True
        self.send_error_json(status, message, "invalid_request_error", code=code, headers=headers)
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)
            drain(self.connection, LINGER_S, time.monotonic() + self.server.limits.timeout, LINGER_BYTES)
        self.connection.settimeout(self.server.limits.timeout)

    def handle_expect_100(self) -> bool:
        # http.server sends 100 Continue as soon as the headers are in; do_POST sends it once every check
        # has passed, so a client never sends a body that is then refused.
        return True

    def admitted(self, path: str) -> bool:
        # Host (DNS rebinding), then the API key (all but /health), then the route and method. An
        # absolute-form target (GET http://name/path, as sent to proxies) names a host too: it must be ours.
        hosts = self.headers.get_all("Host") or []
        target = urlsplit(self.path)
        named = [*hosts, target.netloc.rpartition("@")[2]] if target.scheme or target.netloc else hosts
        if "*" not in self.server.hosts and (len(hosts) != 1 or any(host_name(h) not in self.server.hosts
                                                                    for h in named)):
            hosts = named
            self.refuse(403, f"Host {'; '.join(hosts)[:100] or '(none)'!r} is not this server; allowed: "
                        f"{', '.join(sorted(self.server.hosts))} (--allowed-hosts)", "host_not_allowed")
            return False
        key = self.server.limits.api_key
        given = self.headers.get("Authorization", "").encode()
        if key and path != "/health" and not hmac.compare_digest(given, f"Bearer {key}".encode()):
            self.refuse(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", "invalid_api_key",
                        {"WWW-Authenticate": "Bearer"})
            return False
        if path not in self.routes:
            self.refuse(404, f"no route {self.command} {path}", "not_found")
            return False
        method = self.routes[path]
        if self.command != method and not (self.command == "HEAD" and method == "GET"):  # HEAD: GET's headers
            allow = "GET, HEAD" if method == "GET" else method
            self.refuse(405, f"{self.command} is not allowed on {path}; use {allow}", "method_not_allowed",
                        {"Allow": allow})
            return False
        return True

    def do_other(self) -> None:
        self.admitted(urlsplit(self.path).path)  # answers 403, 401, 404 or 405

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = do_other

    def do_GET(self) -> None:  # and HEAD (send_json leaves out the body)
        path = urlsplit(self.path).path
        # A GET carries no body. One that declares a body is answered and its connection closed, so the
        # body is never read as the next request (request smuggling behind a proxy).
        lengths = self.headers.get_all("Content-Length", [])
        if "Transfer-Encoding" in self.headers or any(v.strip() != "0" for v in lengths):
            self.close_connection = True
        if not self.admitted(path):
            return
        self.reader.lift()
        self.get(path)

    do_HEAD = do_GET

    def body_size(self) -> int | None:
        # The Content-Length, or None after refusing the request. A chunked body has no length to check
        # in advance; two lengths leave the body's end ambiguous (request smuggling behind a proxy).
        lengths = self.headers.get_all("Content-Length") or ["0"]
        if "Transfer-Encoding" in self.headers:
            self.refuse(411, "chunked bodies are not supported: send a Content-Length", "length_required")
        elif len(lengths) > 1 or not re.fullmatch(r"\d{1,16}", lengths[0].strip()):
            self.refuse(400, f"need one Content-Length header with a number of bytes, got {lengths[:2]}",
                        "bad_content_length")
        elif int(lengths[0]) > MAX_BODY:
            self.refuse(413, f"the body needs a Content-Length of 0..{MAX_BODY} bytes", "body_too_large")
        else:
            return int(lengths[0])
        return None

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if not self.admitted(path) or (size := self.body_size()) is None:
            return
        kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if kind != "application/json":  # text/plain, forms: what a web page may POST without a preflight
            return self.refuse(415, f"Content-Type must be application/json, got {kind[:60]!r}",
                               "unsupported_media_type")
        if self.headers.get("Expect", "").strip().lower() == "100-continue" and self.request_version >= "HTTP/1.1":
            self.send_response_only(100)
            self.end_headers()
        body = self.rfile.read(size)
        self.reader.lift()
        if len(body) < size:  # the client closed the connection mid-body
            self.close_connection = True
            return
        self.post(path, body)

    def hung_up(self) -> bool:
        # A look at the socket that does not block: readable with nothing to read = the client closed it.
        # (A pipelined next request is data, not a hang-up. A client that half-closes after sending its
        # request counts as gone, as in most servers.)
        try:
            self.connection.settimeout(0)
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True
        finally:
            self.connection.settimeout(self.server.limits.timeout)

    def wait(self, events: queue.Queue):
        # The next item of `events`; None once the client hung up (the connection is then closed). The socket
        # is looked at every POLL_S, also while items keep coming: a row's text arrives at nearly every step.
        while True:
            if time.monotonic() >= self.next_look:
                self.next_look = time.monotonic() + POLL_S
                if self.hung_up():
                    self.close_connection = True
                    return None
            try:
                return events.get(timeout=POLL_S)
            except queue.Empty:
                pass


# ---- streams: the text that may be sent before the output is finished ----

def stop_cut(text: str, stops: list[str]) -> int:
    # Where the reply ends at its stop strings: the start of the one whose first occurrence ends first (the one a
    # reader of the text one character at a time meets first), -1 for none. The same whatever the steps' sizes: a
    # step that accepts several tokens can complete a longer stop that began before a shorter one inside it.
    found = [(i + len(stop), i) for stop in stops if (i := text.find(stop)) >= 0]
    return min(found)[1] if found else -1


def held_back(text: str, stops: list[str]) -> int:
    # Characters at the end of text that must not be streamed yet: an unfinished UTF-8 character
    # (decoded as U+FFFD until its last byte arrives), and before it the start of a possible stop string.
    done = text.rstrip("\ufffd")
    return len(text) - len(done) + max((overlap(done, x) for x in stops), default=0)


def overlap(text: str, stop: str) -> int:
    # The longest proper prefix of `stop` that ends `text`, by Knuth-Morris-Pratt over the last
    # len(stop) - 1 characters: O(len(stop)). It runs for every row at every decoding step, where a
    # naive endswith() per prefix length, quadratic in len(stop), would stall the whole batch.
    fail = [0] * len(stop)  # fail[i]: the longest proper prefix of stop[:i + 1] that is also its suffix
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        k += stop[i] == stop[k]
        fail[i] = k
    k = 0
    for c in text[max(len(text) - len(stop) + 1, 0):]:  # k < len(stop): the tail is shorter than stop
        while k and c != stop[k]:
            k = fail[k - 1]
        k += c == stop[k]
    return k
