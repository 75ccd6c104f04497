"""Secrets never leave the process: redaction of a command line before it is recorded.

The run's command line (``process.command_args`` on the run span and on the resource) is
the one place where a program's secrets reach a trace: ``train.py --api-key sk-...
--password=hunter2 --db postgres://me:pw@host/db``. Before it is recorded, :func:`redact_args`
replaces, with :data:`REDACTED`:

* the value of an option whose name matches one of the patterns, in either form:
  ``--api-key VALUE`` (the next argument) and ``--api-key=VALUE`` (also a bare
  ``db.password=VALUE``, the Hydra/OmegaConf override form);
* the credentials of a URL (``scheme://user:password@host`` -> ``scheme://***@host``);
* the value of a URL query parameter whose name matches (``?token=VALUE``).

The names stay, so the command line still says what was passed. Patterns are
case-insensitive regular expressions searched in the option's name: :data:`DEFAULT_PATTERNS`
(``key``, ``token``, ``secret``, ``password``, ``passwd``, ``credential``, ``auth``; not
``tokenizer`` nor ``author``), plus those of ``COPYTRACE_REDACT_PATTERNS`` (comma
separated). ``COPYTRACE_REDACT=0`` records the command line as it is. Environment variables
are never recorded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from copytrace import _env

__all__ = ["DEFAULT_PATTERNS", "REDACTED", "Redactor", "redact_args", "redactor"]

#: What a redacted value becomes.
REDACTED = "***"
#: Case-insensitive regular expressions searched in an option's name (without its dashes).
DEFAULT_PATTERNS: tuple[str, ...] = (
    "key",
    "token(?!izer)",
    "secret",
    "password",
    "passwd",
    "credential",
    "auth(?!or)",
)

_OPTION = re.compile(r"^(-{1,2})([A-Za-z0-9][\w.\-]*)$")
_ASSIGN = re.compile(r"^(-{0,2})([A-Za-z_][\w.\-]*)=(.*)$", re.S)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s?#]+)@")
_QUERY_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[^=&;#\s]+)=(?P<value>[^&;#\s]*)")


class Redactor:
    """Redacts with ``patterns`` (regular expressions, searched case-insensitively)."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(patterns)
        self._name = re.compile("|".join(f"(?:{p})" for p in self.patterns), re.I)

    def secret_name(self, name: str) -> bool:
        """True when an option (or query parameter) called ``name`` holds a secret."""
        return bool(self.patterns) and self._name.search(name) is not None

    def text(self, value: str) -> str:
        """``value`` with URL credentials and secret query parameters redacted."""
        if "://" not in value and "=" not in value:
            return value
        value = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{REDACTED}@", value)

        def param(m: re.Match[str]) -> str:
            if self.secret_name(m["name"]) and m["value"]:
                return f"{m['sep']}{m['name']}={REDACTED}"
            return m[0]

        return _QUERY_PARAM.sub(param, value) if "://" in value else value

    def args(self, argv: Sequence[str]) -> list[str]:
        """``argv`` with secrets redacted (same length: one argument per argument)."""
        out: list[str] = []
        secret_next = False
        for arg in argv:
            arg = str(arg)
            if secret_next:
                secret_next = False
                if not arg.startswith("-") or arg == "-":
                    out.append(REDACTED)
                    continue
            opt = _OPTION.match(arg)
            if opt is not None:
                secret_next = self.secret_name(opt[2])
                out.append(arg)
                continue
            assign = _ASSIGN.match(arg)
            if assign is not None and self.secret_name(assign[2]):
                out.append(f"{assign[1]}{assign[2]}={REDACTED}")
                continue
            out.append(self.text(arg))
        return out


def redactor() -> Redactor | None:
    """The redactor the environment asks for (None: ``COPYTRACE_REDACT=0``).

    Raises:
        copytrace.SettingError: ``COPYTRACE_REDACT`` or ``COPYTRACE_REDACT_PATTERNS`` not
            accepted.
    """
    if not _env.setting(_env.COPYTRACE_REDACT):
        return None
    extra = _env.setting(_env.COPYTRACE_REDACT_PATTERNS) or ()
    return Redactor((*DEFAULT_PATTERNS, *extra))


def redact_args(argv: Sequence[str]) -> list[str]:
    """``argv`` as it may be recorded: redacted unless ``COPYTRACE_REDACT=0``; a setting not
    accepted redacts with the default patterns (the launch reports the setting itself)."""
    try:
        red = redactor()
    except _env.SettingError:
        red = Redactor(DEFAULT_PATTERNS)
    return [str(a) for a in argv] if red is None else red.args(argv)
