"""Split the shell blocks of the docs into simple commands, so that each one can be checked against the code.

Enough of POSIX sh for documentation: quotes, `\\` line continuations, comments, `&&` `||` `;` `|` `&`, subshells
and groups, redirections (their targets are dropped), here-documents (their bodies are skipped), `NAME=value`
prefixes, and command substitutions `$(...)` / backticks, whose commands are returned too (before the command that
contains them). Expansions (`$VAR`, `${VAR}`, `$(...)`) stay in the words as written; `Command.dynamic` says which
words hold one. Loops and conditionals are not interpreted: their keywords are dropped and the commands inside kept.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_REDIRECTION = re.compile(r"&>>|&>|<<<|<<-|<<|>>|>&|<&|>\||<>|>|<")
_SEPARATORS = ("&&", "||", ";;", ";", "|&", "|", "&", "(", ")")
_PREFIX_KEYWORDS = {"if", "then", "else", "elif", "do", "while", "until", "!", "{"}
_SKIPPED_KEYWORDS = {"fi", "done", "esac", "}", "for", "case", "select", "function"}


class ShellSyntaxError(ValueError):
    """A block the splitter cannot read (an unclosed quote or substitution)."""


@dataclass(frozen=True)
class Command:
    """One simple command: its words (quotes removed) after its `NAME=value` prefixes."""

    words: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    line: int  # 0-based line of the block where the command starts
    text: str  # the words as a shell would read them back (long ones cut), for messages

    @staticmethod
    def dynamic(word: str) -> bool:
        """Whether the shell would expand `word` (a variable or a substitution): its value is unknown here."""
        return "$" in word or "`" in word


def commands(script: str) -> list[Command]:
    """The simple commands of `script`, in the order the shell would start them (substitutions first)."""
    return _Splitter(script).run()


class _Splitter:
    def __init__(self, text: str, line: int = 0) -> None:
        self.s = text
        self.i = 0
        self.line = line
        self.found: list[Command] = []
        self.words: list[str] = []
        self.word: list[str] | None = None
        self.start = line
        self.drop_next_word = False  # the next word is a redirection's target
        self.heredocs: list[tuple[str, bool]] = []  # (delimiter, strip leading tabs), read after this line

    def run(self) -> list[Command]:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c == "\\":
                if s.startswith("\\\n", self.i):
                    self._newline(consumed=2)
                    continue
                self._add(s[self.i + 1 : self.i + 2])
                self.i += 2
            elif c == "\n":
                self._end_word()
                self._end_command()
                self._newline(consumed=1)
                self._skip_heredocs()
            elif c in " \t":
                self._end_word()
                self.i += 1
            elif c == "#" and self.word is None:
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end
            elif c == "'":
                end = s.find("'", self.i + 1)
                if end < 0:
                    raise ShellSyntaxError(f"line {self.line + 1}: unclosed single quote")
                self._add(s[self.i + 1 : end])
                self._count_lines(self.i, end)
                self.i = end + 1
            elif c == '"':
                self._double_quoted()
            elif c == "$" and s.startswith("$((", self.i):
                end = s.find("))", self.i)
                if end < 0:
                    raise ShellSyntaxError(f"line {self.line + 1}: unclosed $((")
                self._add(s[self.i : end + 2])
                self.i = end + 2
            elif c == "$" and s.startswith("$(", self.i):
                self._substitution(self.i + 2, ")")
            elif c == "$" and s.startswith("${", self.i):
                end = s.find("}", self.i)
                if end < 0:
                    raise ShellSyntaxError(f"line {self.line + 1}: unclosed ${{")
                self._add(s[self.i : end + 1])
                self.i = end + 1
            elif c == "`":
                self._substitution(self.i + 1, "`")
            elif c in "<>" or s.startswith(("&>", "&>>"), self.i):
                self._redirection()
            elif (sep := next((op for op in _SEPARATORS if s.startswith(op, self.i)), None)) is not None:
                self._end_word()
                self._end_command()
                self.i += len(sep)
            else:
                self._add(c)
                self.i += 1
        if self.heredocs:
            raise ShellSyntaxError(f"here-document without its end line {self.heredocs[0][0]!r}")
        self._end_word()
        self._end_command()
        return self.found

    # --- words and commands
    def _add(self, text: str) -> None:
        if self.word is None:
            self.word = []
            if not self.words:
                self.start = self.line
        self.word.append(text)

    def _end_word(self) -> None:
        if self.word is None:
            return
        word, self.word = "".join(self.word), None
        if self.drop_next_word:
            self.drop_next_word = False
        else:
            self.words.append(word)

    def _end_command(self) -> None:
        words, self.words = self.words, []
        env: list[tuple[str, str]] = []
        while words and words[0] in _PREFIX_KEYWORDS:
            words.pop(0)
        while words and _ASSIGNMENT.match(words[0]):
            name, _, value = words.pop(0).partition("=")
            env.append((name, value))
        if words and (words[0] in _SKIPPED_KEYWORDS or words[0].endswith("()")):
            return
        if words or env:
            shown = shlex.join(words)
            shown = shown if len(shown) <= 160 else f"{shown[:150]} ..."
            self.found.append(Command(tuple(words), tuple(env), self.start, shown))

    # --- lines, quotes and substitutions
    def _newline(self, consumed: int) -> None:
        self.i += consumed
        self.line += 1

    def _count_lines(self, start: int, end: int) -> None:
        self.line += self.s.count("\n", start, end)

    def _double_quoted(self) -> None:
        s, i = self.s, self.i + 1
        self._add("")  # "" is a word too
        while True:
            if i >= len(s):
                raise ShellSyntaxError(f"line {self.line + 1}: unclosed double quote")
            c = s[i]
            if c == '"':
                self.i = i + 1
                return
            if c == "\\" and i + 1 < len(s) and s[i + 1] in '$`"\\\n':
                if s[i + 1] == "\n":
                    self.line += 1
                else:
                    self._add(s[i + 1])
                i += 2
            elif s.startswith("$(", i) and not s.startswith("$((", i):
                self.i = i
                self._substitution(i + 2, ")")
                i = self.i
            elif c == "`":
                self.i = i
                self._substitution(i + 1, "`")
                i = self.i
            else:
                if c == "\n":
                    self.line += 1
                self._add(c)
                i += 1

    def _substitution(self, start: int, close: str) -> None:
        """`$(...)` or a backtick substitution from `start` (just after its opening): its commands are split too."""
        end = _closing(self.s, start, close)
        if end < 0:
            raise ShellSyntaxError(f"line {self.line + 1}: unclosed command substitution")
        inner = _Splitter(self.s[start:end], self.line)
        self.found.extend(inner.run())
        self._add(self.s[self.i : end + 1])
        self._count_lines(start, end)
        self.i = end + 1

    # --- redirections and here-documents
    def _redirection(self) -> None:
        if self.word is not None and "".join(self.word).isdigit():
            self.word = None  # a file descriptor: `2>&1`
        self._end_word()
        match = _REDIRECTION.match(self.s, self.i)
        assert match is not None
        op = match.group()
        self.i = match.end()
        if op in (">&", "<&"):
            fd = re.compile(r"\d+-?|-").match(self.s, self.i)
            if fd is not None:
                self.i = fd.end()
                return
        if op in ("<<", "<<-"):
            while self.s[self.i : self.i + 1] in (" ", "\t"):
                self.i += 1
            delimiter = re.compile(r"""(['"]?)([^\s'";&|<>()]+)\1""").match(self.s, self.i)
            if delimiter is None:
                raise ShellSyntaxError(f"line {self.line + 1}: here-document without a delimiter")
            self.heredocs.append((delimiter.group(2), op == "<<-"))
            self.i = delimiter.end()
            return
        self.drop_next_word = True

    def _skip_heredocs(self) -> None:
        while self.heredocs:
            delimiter, strip_tabs = self.heredocs.pop(0)
            while True:
                if self.i >= len(self.s):
                    raise ShellSyntaxError(f"here-document without its end line {delimiter!r}")
                end = self.s.find("\n", self.i)
                end = len(self.s) if end < 0 else end
                line = self.s[self.i : end]
                self.i = min(end + 1, len(self.s))
                self.line += 1
                if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                    break


def _closing(s: str, start: int, close: str) -> int:
    """The index of the `close` that ends a substitution opened just before `start` (-1: none), past nested
    parentheses and quotes."""
    depth, i = 0, start
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == "'" and close == ")":
            i = s.find("'", i + 1)
            if i < 0:
                return -1
        elif c == '"' and close == ")":
            i += 1
            while i < len(s) and s[i] != '"':
                i += 2 if s[i] == "\\" else 1
        elif c == "(" and close == ")":
            depth += 1
        elif c == close:
            if depth == 0:
                return i
            depth -= 1
        i += 1
    return -1
