"""``lynx generate --stream``: the generation's events as text on a terminal.

:class:`TokenStream` is pure (events in, text out; no I/O): the CLI writes what
:meth:`TokenStream.feed` returns to stdout and flushes. On a terminal
(``tty=True``) tentative tokens are drawn dim (SGR 2) after the committed text;
when the verify pass answers, the tentative region is erased and redrawn: the
accepted tokens as committed text, the withdrawn ones gone (a rollback erases
them at once), the rest dim again. Unverified tokens (the exact cache never came,
``--on-missing-residual unverified``) are drawn yellow. Without a terminal
(``tty=False``: a pipe, a file) only the final text is written, as it is committed,
and no escape codes at all.

Erasing needs no terminal support beyond cursor-up, set-column and erase-below
(``ESC[nA``, ``ESC[nG``, ``ESC[J``): the class follows where the cursor is in a
``width``-column terminal (wide characters, tabs, line wraps), so a tentative
region that wraps or holds newlines is erased from its first cell. It assumes
the cursor is at column 0 when the stream starts, and that nothing else writes
to the terminal meanwhile.

Text is detokenized incrementally: each region is the detokenization of all its
ids so far. An incomplete UTF-8 sequence at the end of the final text, shown as
U+FFFD, is held back until the next token completes it or the run ends; in the
tentative region (erased at each redraw) it is drawn, dim, as U+FFFD, so a token
is seen as soon as it comes.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

from lynx_decode.events import Committed, Done, Event, Rollback, Tentative, Unverified

__all__ = ["TokenStream", "DIM", "RESET", "UNVERIFIED"]

#: SGR sequences: dim (tentative), yellow (unverified), reset
DIM = "\x1b[2m"
UNVERIFIED = "\x1b[33m"
RESET = "\x1b[0m"
ERASE_BELOW = "\x1b[J"
_HELD = "\ufffd"  # an incomplete UTF-8 sequence at the end of a detokenization


def _width(ch: str) -> int:
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


class _Cursor:
    """Where the cursor is, in rows from where the stream started and columns
    (``col == width``: the last column is written, the wrap is pending, as xterm does)."""

    def __init__(self, width: int) -> None:
        self.width = max(1, width)
        self.row = 0
        self.col = 0

    def advance(self, text: str) -> str:
        """Move over ``text`` (no control characters but newlines and tabs); returns
        it as written, tabs expanded to spaces up to the next multiple of 8 columns."""
        out = []
        for ch in text:
            if ch == "\t":
                spaces = 8 - self.col % 8 if self.col < self.width else 8
                out.append(self.advance(" " * spaces))
                continue
            out.append(ch)
            if ch == "\n":
                self.row, self.col = self.row + 1, 0
                continue
            w = _width(ch)
            if w and self.col + w > self.width:
                self.row, self.col = self.row + 1, 0
            self.col += w
        return "".join(out)

    def next_cell(self) -> tuple[int, int]:
        """Where the next character goes (a pending wrap: the next row's first cell)."""
        return (self.row + 1, 0) if self.col >= self.width else (self.row, self.col)

    def back_to(self, row: int, col: int) -> str:
        """Escapes that move the cursor back to ``(row, col)``, a cell at or before it
        (none when the cursor never got there: nothing was drawn from it)."""
        if (self.row, self.col) < (row, col):
            return ""
        up = self.row - row
        self.row, self.col = row, col
        return (f"\x1b[{up}A" if up > 0 else "") + f"\x1b[{col + 1}G"


def _printable(text: str, final: bool) -> str:
    return text if final else text.rstrip(_HELD)


def _visible(text: str) -> str:
    """Control characters the terminal would act on, except newline and tab, as
    their Unicode pictures (U+2400...), so the cursor model stays right."""
    return "".join(ch if ch in "\n\t" or unicodedata.category(ch) != "Cc"
                   else (chr(0x2400 + ord(ch)) if ord(ch) < 0x20 else "\u2421") for ch in text)


class TokenStream:
    """Turns generation events into text for a terminal (``tty``) or a pipe.

    ``detokenize``: the model's (``model.detokenize``). ``width``: the terminal's
    columns (only used with ``tty``). Feed every event of one run in order to
    :meth:`feed`; it returns the text to write (possibly empty). After
    :class:`Done` the final text is complete and the output ends with a newline.
    """

    def __init__(self, detokenize: Callable[[Sequence[int]], str], *, tty: bool, width: int = 80) -> None:
        self._detok = detokenize
        self.tty = tty
        self._final: list[int] = []      # committed, then unverified ids
        self._tentative: list[int] = []  # ids at positions len(_final)..
        self._shown_final = ""           # final text written
        self._shown_tentative = ""       # tentative text on screen (tty)
        self._cursor = _Cursor(width)
        self._mark = (0, 0)              # where the tentative region starts (tty)
        self.rollbacks = 0
        self.withdrawn = 0
        self.done = False

    # -- events ---------------------------------------------------------------------------
    def feed(self, event: Event) -> str:
        if self.done:
            return ""
        if isinstance(event, Tentative):
            keep = max(0, event.position - len(self._final))
            self._tentative = [*self._tentative[:keep], event.token]
            return self._redraw(DIM)
        if isinstance(event, Rollback):
            keep = max(0, event.from_position - len(self._final))
            self.rollbacks += 1
            self.withdrawn += event.n_rejected
            self._tentative = self._tentative[:keep]
            return self._redraw(DIM)
        if isinstance(event, (Committed, Unverified)):
            before = len(self._final)
            self._final[event.position:] = event.tokens
            # tentative tokens at the positions now final are answered (taken or replaced)
            self._tentative = self._tentative[max(0, len(self._final) - before):]
            return self._redraw("" if isinstance(event, Committed) else UNVERIFIED)
        if isinstance(event, Done):
            self._tentative = []
            out = self._redraw("", final=True)
            self.done = True
            return out + ("\n" if self._shown_final and not self._shown_final.endswith("\n") else "")
        return ""

    def abort(self) -> str:
        """The run failed: erase the tentative tokens (void) and end the line."""
        if self.done:
            return ""
        self._tentative = []
        out = self._redraw("")
        self.done = True
        return out + ("\n" if self._shown_final and not self._shown_final.endswith("\n") else "")

    # -- drawing ------------------------------------------------------------------------------
    def _texts(self, final: bool) -> tuple[str, str]:
        """(final text, tentative text) as they should be shown now."""
        shown = _printable(self._detok(self._final), final) if self._final else ""
        if not self._tentative or not self.tty:
            return shown, ""
        both = self._detok([*self._final, *self._tentative])
        tail = both[len(shown):] if both.startswith(shown) else self._detok(self._tentative)
        # an incomplete UTF-8 sequence stays in the tentative region as U+FFFD: a token came
        # (the reader sees it at once), and the region is redrawn when the sequence completes
        return shown, tail

    def _redraw(self, style: str, final: bool = False) -> str:
        target_final, target_tentative = self._texts(final)
        # final text is never erased: should a longer detokenization not extend what
        # was written (not seen with byte-level BPE), only what goes past it is added
        new_final = target_final[len(self._shown_final):]
        if not self.tty:
            self._shown_final += new_final
            return new_final
        out = []
        if new_final or not target_tentative.startswith(self._shown_tentative):
            move = self._cursor.back_to(*self._mark) if self._shown_tentative else ""
            if move:  # erase the tentative region: back to its start, clear below
                out.append(move + ERASE_BELOW)
            self._shown_tentative = ""
            if new_final:
                out.append(self._write(new_final, style))
                self._shown_final += new_final
            self._mark = self._cursor.next_cell()
        more = target_tentative[len(self._shown_tentative):]
        if more:
            out.append(self._write(more, DIM))
            self._shown_tentative += more
        return "".join(out)

    def _write(self, text: str, style: str) -> str:
        text = self._cursor.advance(_visible(text))
        return f"{style}{text}{RESET}" if style else text
