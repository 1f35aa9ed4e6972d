"""`lynx generate --stream` and the fail-fast probe of `--connect`.

The renderer (``lynx_bench.nodes.token_stream.TokenStream``) is pure: events in, text out.
Its terminal output is checked on a small terminal emulator (``_Screen``, below: a
grid of cells with xterm's pending wrap, cursor-up, set-column, erase-below and SGR
dim/yellow) against the same emulator fed the text that should be visible (the
final text, then the tentative text dim), after every event. Then the whole CLI
(``generate.run``, a toy model, both nodes over the in-memory transport) runs
in a child process whose stdout is a pseudo-terminal, and once more into a pipe.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import select
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import unicodedata
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from lynx_bench import cli
from lynx_bench.nodes import generate
from lynx_bench.nodes.token_stream import DIM, RESET, UNVERIFIED, TokenStream
from lynx_decode.events import Committed, DecodeMetrics, Done, Event, Rollback, Tentative, Unverified
from lynx_transport.errors import ConnectError
from tests._lynx_cli import LynxRun, run_lynx

REPO = Path(__file__).resolve().parents[2]
METRICS = DecodeMetrics(ttft_s=0.1, ttfct_s=0.3, e2e_s=0.5, acceptance_rate=0.5, drafted=4, accepted=2,
                        new_tokens=5, speculative=True, draft_start_s=0.0, full_ready_s=0.2, verify_s=0.05,
                        stopped_at_eos=False)


# -- a terminal, for checking what the escapes draw ------------------------------------------
class _Screen:
    """Enough of xterm for the renderer: printable cells (wide ones take two), CR, LF,
    ``ESC[nA``, ``ESC[nG``, ``ESC[J``, SGR 0/2/33; the last column's pending wrap."""

    def __init__(self, width: int, *, expand_tabs: bool = False) -> None:
        self.width = width
        self.expand_tabs = expand_tabs  # for the expected screen: tabs as the renderer writes them
        self.rows: list[list[tuple[str, str]]] = [[]]
        self.row = self.col = 0
        self.pending = False
        self.style = ""

    def _cell(self, row: int, col: int, value: tuple[str, str]) -> None:
        while len(self.rows) <= row:
            self.rows.append([])
        line = self.rows[row]
        while len(line) <= col:
            line.append((" ", ""))
        line[col] = value

    def _newline(self) -> None:
        self.row += 1
        self.pending = False
        while len(self.rows) <= self.row:
            self.rows.append([])

    def feed(self, data: str) -> None:
        i = 0
        while i < len(data):
            ch = data[i]
            if ch == "\x1b":
                assert data[i + 1] == "[", f"unexpected escape {data[i:i + 6]!r}"
                j = i + 2
                while not data[j].isalpha():
                    j += 1
                param, op = data[i + 2:j], data[j]
                self._csi(param, op)
                i = j + 1
                continue
            i += 1
            if ch == "\r":
                self.col, self.pending = 0, False
            elif ch == "\n":
                self._newline()
                self.col = 0  # as a terminal behind the tty's onlcr (CR LF); tests feed LF alone
            elif ch == "\t" and self.expand_tabs:
                at = 0 if self.pending else self.col
                self.feed(" " * (8 - at % 8))
            else:
                assert unicodedata.category(ch) != "Cc", f"control character {ch!r} reached the terminal"
                w = 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
                if self.pending or self.col + w > self.width:
                    self._newline()
                    self.col = 0
                self._cell(self.row, self.col, (ch, self.style))
                if w == 2:
                    self._cell(self.row, self.col + 1, ("", self.style))
                if self.col + w >= self.width:
                    self.col, self.pending = self.width - 1, True
                else:
                    self.col += w

    def _csi(self, param: str, op: str) -> None:
        n = int(param) if param else None
        if op == "m":
            self.style = {None: "", 0: "", 2: "dim", 33: "yellow"}[n]
        elif op == "A":
            self.row, self.pending = max(0, self.row - (n or 1)), False
        elif op == "G":
            self.col, self.pending = min(self.width, n or 1) - 1, False
        elif op == "J":
            assert n in (None, 0)
            self.rows[self.row] = self.rows[self.row][: self.col]
            del self.rows[self.row + 1:]
        else:
            raise AssertionError(f"unexpected CSI {param}{op}")

    def cells(self) -> list[list[tuple[str, str]]]:
        out = [list(r) for r in self.rows]
        for line in out:
            while line and line[-1] == (" ", ""):
                line.pop()
        while out and not out[-1]:
            out.pop()
        return out

    def text(self) -> str:
        return "\n".join("".join(c for c, _ in line) for line in self.cells())


def _expected(width: int, final: str, tentative: str, unverified: str = "") -> list[list[tuple[str, str]]]:
    """The cells that should show: ``final`` plain, ``unverified`` yellow, ``tentative`` dim."""
    screen = _Screen(width, expand_tabs=True)
    screen.feed(final + UNVERIFIED + unverified + RESET + DIM + tentative + RESET)
    return screen.cells()


# -- toy vocabularies ---------------------------------------------------------------------------
WORDS = ["Hello", ",", " world", "!", " How", " are", " you", "\n", " fine", "\t", "長い", "文", "é", " ok."]


def _detok(ids: Sequence[int]) -> str:
    return "".join(WORDS[i] for i in ids)


def _feed(stream: TokenStream, events: Sequence[Event]) -> str:
    return "".join(stream.feed(e) for e in events)


ROLLBACK_RUN: list[Event] = [
    Tentative(0, 0), Tentative(1, 1), Tentative(2, 2), Tentative(3, 3),
    Rollback(2, 2), Committed((0, 1, 4), 0), Committed((5,), 3), Committed((6,), 4),
    Done(METRICS, (0, 1, 4, 5, 6)),
]


def test_to_a_pipe_only_committed_text_and_no_escape_codes() -> None:
    stream = TokenStream(_detok, tty=False)
    parts = [stream.feed(e) for e in ROLLBACK_RUN]
    assert parts[:5] == ["", "", "", "", ""]  # tentative tokens and the rollback show nothing
    out = "".join(parts)
    assert out == "Hello, How are you\n"
    assert "\x1b" not in out and "world" not in out
    assert (stream.rollbacks, stream.withdrawn) == (1, 2)


def test_on_a_terminal_tentative_is_dim_withdrawn_is_erased_committed_is_plain() -> None:
    width = 80
    stream, screen = TokenStream(_detok, tty=True, width=width), _Screen(width)
    screen.feed(_feed(stream, ROLLBACK_RUN[:4]))
    assert screen.cells() == _expected(width, "", "Hello, world!")
    assert {s for line in screen.cells() for _, s in line} == {"dim"}
    screen.feed(stream.feed(ROLLBACK_RUN[4]))  # the rollback: " world!" goes at once
    assert screen.text() == "Hello," and screen.cells() == _expected(width, "", "Hello,")
    screen.feed(stream.feed(ROLLBACK_RUN[5]))  # committed: drawn plain
    assert screen.cells() == _expected(width, "Hello, How", "")
    screen.feed(_feed(stream, ROLLBACK_RUN[6:]))
    assert screen.text() == "Hello, How are you"
    assert {s for line in screen.cells() for _, s in line} == {""}


def _random_run(rng: random.Random) -> Iterator[Event]:
    """A run as the engine emits it: drafts, a verify pass (rollback, commit), and
    sometimes an intermediate level (tentative tokens re-issued) or no verification."""
    final: list[int] = []
    tentative: list[int] = []

    def tok() -> int:
        return rng.randrange(len(WORDS))

    for _ in range(rng.randint(1, 4)):
        for _ in range(rng.randint(0, 6)):
            tentative.append(tok())
            yield Tentative(tentative[-1], len(final) + len(tentative) - 1)
        accepted = rng.randint(0, len(tentative))
        if accepted < len(tentative):
            yield Rollback(len(final) + accepted, len(tentative) - accepted)
        kept = [*tentative[:accepted], tok()]
        tentative = []
        if rng.random() < 0.3:  # an intermediate level: re-issued as tentative
            for i in range(accepted, len(kept)):
                tentative = kept[: i + 1]
                yield Tentative(kept[i], len(final) + i)
            tentative = list(kept)
            continue
        if rng.random() < 0.15:
            yield Unverified(tuple(tentative or kept), len(final))
            final += tentative or kept
            yield Done(METRICS, tuple(final))
            return
        yield Committed(tuple(kept), len(final))
        final += kept
    if tentative:
        yield Committed(tuple(tentative), len(final))
        final += tentative
    yield Done(METRICS, tuple(final))


@pytest.mark.parametrize("seed", range(200))
def test_the_terminal_always_shows_final_text_then_dim_tentative_text(seed: int) -> None:
    rng = random.Random(seed)
    width = rng.choice([3, 5, 8, 11, 20, 80])
    stream, screen = TokenStream(_detok, tty=True, width=width), _Screen(width)
    pipe = TokenStream(_detok, tty=False)
    final: list[int] = []
    tentative: list[int] = []
    unverified_from: int | None = None
    piped = ""
    for event in _random_run(rng):
        screen.feed(stream.feed(event))
        piped += pipe.feed(event)
        if isinstance(event, Tentative):
            tentative = [*tentative[: event.position - len(final)], event.token]
        elif isinstance(event, Rollback):
            tentative = tentative[: event.from_position - len(final)]
        elif isinstance(event, (Committed, Unverified)):
            if isinstance(event, Unverified) and unverified_from is None:
                unverified_from = event.position
            tentative = tentative[len(event.tokens):]
            final[event.position:] = event.tokens
        elif isinstance(event, Done):
            tentative = []
        committed = _detok(final[: len(final) if unverified_from is None else unverified_from])
        want = _expected(width, committed, _detok(tentative), _detok(final)[len(committed):])
        got = screen.cells()
        assert [[c for c, _ in line] for line in got] == [[c for c, _ in line] for line in want], event
        assert got == want, event
    assert piped == _detok(final) + ("\n" if final and not _detok(final).endswith("\n") else "")
    assert "\x1b" not in piped


def test_a_line_filled_to_the_last_column_loses_nothing_when_the_tentative_text_goes() -> None:
    width = 6  # "Hello," fills the row: the cursor waits in the last column (pending wrap)
    stream, screen = TokenStream(_detok, tty=True, width=width), _Screen(width)
    screen.feed(_feed(stream, [Committed((0, 1), 0), Tentative(2, 2), Tentative(7, 3), Tentative(4, 4)]))
    assert screen.text() == "Hello,\n world\n How"
    screen.feed(stream.feed(Rollback(2, 3)))
    assert screen.text() == "Hello,"
    screen.feed(_feed(stream, [Committed((3,), 2), Done(METRICS, (0, 1, 3))]))
    assert screen.text() == "Hello,\n!"


def test_an_incomplete_utf8_sequence_waits_for_its_last_byte() -> None:
    pieces = [b"caf", b"\xc3", b"\xa9!"]

    def detok(ids: Sequence[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    stream = TokenStream(detok, tty=False)
    assert stream.feed(Committed((0,), 0)) == "caf"
    assert stream.feed(Committed((1,), 1)) == ""  # half of é: held back
    assert stream.feed(Committed((2,), 2)) == "é!"
    assert stream.feed(Done(METRICS, (0, 1, 2))) == "\n"


def test_a_tentative_token_inside_a_utf8_sequence_is_shown_dim_until_it_completes() -> None:
    pieces = [b"caf", b"\xc3", b"\xa9!"]

    def detok(ids: Sequence[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    stream, screen = TokenStream(detok, tty=True), _Screen(80)
    screen.feed(_feed(stream, [Committed((0,), 0), Tentative(1, 1)]))
    assert screen.text() == "caf\ufffd" and screen.cells()[0][-1] == ("\ufffd", "dim")  # the token came
    screen.feed(_feed(stream, [Tentative(2, 2)]))
    assert screen.text() == "café!"
    screen.feed(_feed(stream, [Committed((1, 2), 1), Done(METRICS, (0, 1, 2))]))
    assert screen.text() == "café!" and {s for line in screen.cells() for _, s in line} == {""}


def test_unverified_tokens_are_yellow_and_a_failed_run_erases_its_tentative_tokens() -> None:
    stream, screen = TokenStream(_detok, tty=True), _Screen(80)
    screen.feed(_feed(stream, [Tentative(0, 0), Tentative(1, 1), Unverified((0, 1), 0), Unverified((2,), 2)]))
    assert screen.text() == "Hello, world"
    assert {s for line in screen.cells() for _, s in line} == {"yellow"}
    stream, screen = TokenStream(_detok, tty=True), _Screen(80)
    screen.feed(_feed(stream, [Committed((0,), 0), Tentative(1, 1), Tentative(2, 2)]))
    assert screen.text() == "Hello, world"
    tail = stream.abort()
    screen.feed(tail)
    assert tail.endswith("\n") and screen.text() == "Hello"
    assert stream.feed(Tentative(3, 3)) == ""  # nothing after the end


def test_control_characters_are_shown_not_obeyed() -> None:
    words = ["a\rb", "\x1b[31m", "\x07"]
    stream, screen = TokenStream(lambda ids: "".join(words[i] for i in ids), tty=True), _Screen(80)
    screen.feed(_feed(stream, [Committed((0, 1, 2), 0), Done(METRICS, (0, 1, 2))]))
    assert screen.text() == "a\u240db\u241b[31m\u2407"
    piped = _feed(TokenStream(lambda ids: "".join(words[i] for i in ids), tty=False),
                  [Committed((0, 1, 2), 0), Done(METRICS, (0, 1, 2))])
    assert piped == "a\rb\x1b[31m\x07\n"  # a pipe gets the text itself


# -- the whole CLI, in a child, to a pseudo-terminal and to a pipe -------------------------------
def _toy_run(argv: list[str]) -> int:
    """Child side: ``generate.run`` with a toy model, against a prefill node of the
    same toy model in this process, both over the in-memory transport."""
    from lynx_decode.prefill_node import PrefillNode
    from lynx_decode.timeouts import Timeouts
    from lynx_transport.testing import MemoryTransport
    from tests._speculative_helpers import ToyLM

    class TextToyLM(ToyLM):
        def tokenize(self, text: str) -> list[int]:
            return [1 + (ord(c) % 30) for c in text]

        def chat_prompt(self, message: str) -> list[int]:
            return [2, *self.tokenize(message)]

        def detokenize(self, token_ids: Sequence[int]) -> str:
            return "".join(f" t{t}" for t in token_ids)

    model = TextToyLM(eos=False)
    transport = MemoryTransport()
    original = generate.decode_node
    generate.load_model = lambda args: model  # type: ignore[assignment]
    generate.probe = lambda server, timeout: None  # type: ignore[assignment]  # no TCP here
    generate.decode_node = lambda args, m: _holding(original(args, m, transport=transport))  # type: ignore[assignment]
    with PrefillNode(model, transport=transport, timeouts=Timeouts(stream_s=10.0)) as prefill:
        stop = threading.Event()
        server = threading.Thread(target=prefill.serve, args=(stop,), kwargs={"poll_s": 0.02})
        server.start()
        try:
            parser = argparse.ArgumentParser()
            generate.add_arguments(parser)
            host, port = prefill.address
            args = parser.parse_args(["--connect", f"{host}:{port}", *argv])
            return generate.run(args)
        finally:
            stop.set()
            server.join(5)


def _holding(node: Any) -> Any:
    """The decode node with the residual held until the first token is out: the toy's
    cache would otherwise land whole before the first step, which then reads exact K/V in
    every layer, commits at once and drafts nothing to show."""
    run = node.run
    node.run = lambda *args, **kwargs: run(*args, hold_residual=True, **kwargs)
    return node


def _child(tmp_path: Path, *flags: str) -> list[str]:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the quick brown fox jumps over the lazy dog " * 4)
    # the checkout goes last on sys.path (the Makefile's PYTHONSAFEPATH keeps it off the front,
    # where its kernels/ would hide the PyPI package kernels)
    root = str(Path(__file__).resolve().parents[2])
    code = (f"import sys; sys.path.append({root!r}); from tests.unit.test_generate_stream import _toy_run; "
            "sys.exit(_toy_run(sys.argv[1:]))")
    return [sys.executable, "-c", code, "--prompt-file", str(prompt), "--json", str(tmp_path / "o.json"),
            "--max-new-tokens", "12", *flags]


def _read_all(fd: int, proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out


def test_stream_on_a_pseudo_terminal_draws_dim_tentative_tokens(tmp_path: Path) -> None:
    master, slave = os.openpty()
    width = 40  # the toy's 12 tokens take more: the tentative region wraps
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, width, 0, 0))
    env = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, "TERM": "xterm"}
    try:
        proc = subprocess.Popen(_child(tmp_path, "--stream"), stdin=subprocess.DEVNULL, stdout=slave,
                                stderr=subprocess.PIPE, cwd=REPO, env=env)
        os.close(slave)
        raw = _read_all(master, proc, 60)
        _, err = proc.communicate(timeout=30)
    finally:
        os.close(master)
    assert proc.returncode == 0, err.decode()
    out = raw.decode()
    run = json.loads((tmp_path / "o.json").read_text())
    assert DIM in out  # tentative tokens, dim
    assert "\x1b[J" in out  # erased when the verify pass answered
    screen, text = _Screen(width), _Screen(width)
    screen.feed(out)
    text.feed(run["text"] + "\n")
    rows = len(text.cells())
    assert rows > 1 and screen.cells()[:rows] == text.cells()  # the text, wrapped, all plain
    closing = "".join("".join(c for c, _ in line) for line in screen.cells()[rows:])
    assert closing.startswith("lynx: ttft_s=") and "acceptance=" in closing and "ttfct_s=" in closing
    assert {s for line in screen.cells() for _, s in line} == {""}  # nothing left dim


def test_stream_into_a_pipe_is_plain_committed_text_and_the_closing_line(tmp_path: Path) -> None:
    proc = subprocess.run(_child(tmp_path, "--stream"), stdin=subprocess.DEVNULL, capture_output=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    run = json.loads((tmp_path / "o.json").read_text())
    assert "\x1b" not in out
    text, closing = out.rstrip("\n").rsplit("\n", 1)
    assert text == run["text"]
    assert closing.startswith("lynx: ttft_s=") and f"tokens={len(run['tokens'])}" in closing
    kinds = {e["kind"] for e in run["token_events"]}
    assert {"tentative", "committed"} <= kinds
    assert all(e["t_s"] >= 0 for e in run["token_events"])


def test_without_stream_the_output_is_as_before(tmp_path: Path) -> None:
    proc = subprocess.run(_child(tmp_path), stdin=subprocess.DEVNULL, capture_output=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    run = json.loads((tmp_path / "o.json").read_text())
    summary, text = proc.stdout.decode().split("\n", 1)
    assert summary.startswith("lynx: ttft_s=") and text == run["text"] + "\n"


# -- fail fast: nobody at --connect ----------------------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_generate_against_a_closed_port_fails_at_once_without_loading_the_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_model(args: argparse.Namespace) -> None:
        raise AssertionError("the model was loaded before the prefill node was probed")

    monkeypatch.setattr(generate, "load_model", no_model)
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    port = _closed_port()
    start = time.monotonic()
    rc = cli.main(["generate", "--connect", f"127.0.0.1:{port}", "--prompt-file", str(prompt),
                   "--json", str(tmp_path / "o.json"), "--connect-timeout", "60"])
    assert rc == 2
    err = capsys.readouterr().err
    # refused by the kernel, not timed out: so well within the minute it was allowed
    assert f"lynx: error: --connect 127.0.0.1:{port}: no prefill node there (Connection refused)" in err
    assert "lynx serve" in err
    assert time.monotonic() - start < 30
    assert not (tmp_path / "o.json").exists()


def _closed_port_run(tmp_path: Path) -> tuple[LynxRun, int]:
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    port = _closed_port()
    return run_lynx("generate", "--connect", f"127.0.0.1:{port}", "--prompt-file", str(prompt),
                    "--json", str(tmp_path / "o.json"), timeout=120), port


def test_the_real_command_against_a_closed_port_fails_before_it_imports_the_model(tmp_path: Path) -> None:
    run, port = _closed_port_run(tmp_path)
    assert run.returncode == 2, run.stderr
    assert f"127.0.0.1:{port}: no prefill node there (Connection refused)" in run.stderr
    assert not (tmp_path / "o.json").exists()
    assert run.imported == set(), f"imported {sorted(run.imported)} before failing: the model stack loaded"
    assert run.seconds < 20  # a generous bound: the fast start is a timing check, below


@pytest.mark.timing
def test_the_real_command_against_a_closed_port_fails_within_two_seconds(tmp_path: Path, timing) -> None:
    run, _ = _closed_port_run(tmp_path)
    assert run.returncode == 2, run.stderr
    timing.less_than("a fresh `lynx generate` against a closed port, start to exit", run.seconds, 2.0)


def test_the_probe_passes_where_someone_listens_and_names_the_address_where_not() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        generate.probe(server.getsockname()[:2], 1.0)
    port = _closed_port()
    with pytest.raises(ConnectError, match=f"--connect 127.0.0.1:{port}: no prefill node there"):
        generate.probe(("127.0.0.1", port), 1.0)


def test_bad_flags_still_fail_before_the_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_probe(server: Any, timeout: float) -> None:
        raise AssertionError("probed before the flags were checked")

    monkeypatch.setattr(generate, "probe", no_probe)
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    for flags, message in ((["--timeline", str(tmp_path / "t.gif")], "--timeline: .* must end in"),
                           (["--timeline", str(tmp_path / "nowhere" / "t.png")], "--timeline: folder")):
        args = parser.parse_args(["--connect", "127.0.0.1:1", "--prompt-file", str(prompt),
                                  "--json", str(tmp_path / "o.json"), *flags])
        with pytest.raises(Exception, match=message):
            generate.run(args)
