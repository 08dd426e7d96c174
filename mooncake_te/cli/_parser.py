# SPDX-License-Identifier: Apache-2.0
"""What every ``mooncake-te`` command shares: an argument parser that answers a typo with
the name it meant, a help formatter that shows real defaults only, and the argument types
that turn bad values into a usage error (exit status 2) before any work starts."""
from __future__ import annotations

import argparse
import difflib
import re

# Mooncake's transfer_engine_bench spells its flags gflags-style; ours are answered with
# the right one (bench also accepts these names as aliases).
MOONCAKE_FLAGS = {
    "--metadata_server": "--metadata", "--segment_id": "--segment", "--operation": "--op",
    "--block_size": "--block-sizes", "--batch_size": "--batch-size",
    "--local_server_name": "--host", "--device_name": "--device",
}

# The parser that parsed last: the innermost subcommand, whose options a typo is matched
# against (argparse reports leftovers from the top-level parser).
_innermost: "list[Parser]" = []


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with did-you-mean for commands, choices and flags."""

    def parse_known_args(self, args=None, namespace=None):
        _innermost.append(self)
        return super().parse_known_args(args, namespace)

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            hint = _close(str(value), choices)
            name = argparse._get_action_name(action) or "value"
            raise argparse.ArgumentError(
                None, f"argument {name}: invalid choice: {value!r}"
                      + (f"; did you mean {hint!r}?" if hint else "")
                      + f" (choose from {', '.join(choices)})")

    def error(self, message):
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            target = _innermost[-1] if _innermost else self
            hints = [h for h in (_flag_hint(target, a) for a in m.group(1).split()) if h]
            if hints:
                message += "; " + "; ".join(hints)
            target.print_usage(_stderr())
            self.exit(2, f"{target.prog}: error: {message}\n")
        super().error(message)


def _stderr():
    import sys
    return sys.stderr


def _close(word: str, options) -> str | None:
    got = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return got[0] if got else None


def _flag_hint(parser: argparse.ArgumentParser, arg: str) -> str | None:
    if not arg.startswith("--"):
        return None
    flag = arg.split("=", 1)[0]
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    if flag in MOONCAKE_FLAGS and MOONCAKE_FLAGS[flag] in known:
        return f"{flag} is Mooncake's name; here it is {MOONCAKE_FLAGS[flag]}"
    dashed = flag.replace("_", "-")
    if dashed in known:
        return f"did you mean {dashed}?"
    hint = _close(flag, known) or _close(dashed, known)
    return f"did you mean {hint}?" if hint else None


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` where an option has a real default and its help does not
    already say one (argparse's ArgumentDefaultsHelpFormatter also prints
    ``(default: None)`` and doubles defaults the text states)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings or action.nargs == 0):
            return text
        return f"{text} (default: %(default)s)"


# --- argument types: a bad value is a usage error (exit 2), said in the CLI's words -----
def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free one)."""
    try:
        n = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port: use 1..65535, or 0 for any "
                                         f"free port")
    return n


METADATA_FORMS = "p2p, etcd://HOST:2379, redis://HOST:6379, http://HOST:8080/metadata"


def metadata_url(text: str) -> str:
    """A metadata backend as ``TransferEngine(metadata=...)`` takes it."""
    from ..metadata.url import STORE_SCHEMES, parse
    t = text.strip()
    u = parse(t)
    if u.is_p2p and t:
        return t
    if not u.explicit:
        if re.fullmatch(r"[\w.\-\[\]:]+:\d+(,[\w.\-\[\]:]+:\d+)*", t):
            return t        # a bare host:port is etcd, as in Mooncake
        raise argparse.ArgumentTypeError(f"unknown metadata backend {text!r}; use one of "
                                         f"{METADATA_FORMS}")
    if not u.known or not u.address:
        hint = _close(u.scheme, list(STORE_SCHEMES))
        raise argparse.ArgumentTypeError(
            f"unknown metadata backend {text!r}"
            + (f" (did you mean {hint}://{u.address}?)" if hint else "")
            + f"; use one of {METADATA_FORMS}")
    return t


def size(text: str) -> int:
    """A byte size such as 128M, 4K or 1G (checked against this machine's memory by the
    command that allocates it)."""
    from ..units import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def memory_bytes() -> int | None:
    """Physical memory of this machine (MemTotal), or None when /proc does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
