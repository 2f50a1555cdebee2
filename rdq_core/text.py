"""Text from a task (ids, error messages, payload-derived strings) made safe for a terminal."""

from __future__ import annotations


def printable(text: object) -> str:
    """``text`` with every non-printable character (C0/C1 controls, ESC, DEL, newlines, bidi and
    other format characters) written as a Python escape (``\\x1b``, ``\\n``, ``\\u202e``).

    A handler that puts its input in an error message would otherwise let a task payload retitle
    the operator's terminal, clear it, or forge a log line. Machine-readable (JSON) output does
    not need this: JSON escapes control characters itself.
    """
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
