"""What every `python -m ud_transport` subcommand shares: a bad value ends in one line on stderr
saying what was wrong and exit status 2 (never a traceback), and `--help` shows every default.

Values are checked as they are parsed, by the `type=` helpers below, so each option's rule sits
next to the option and argparse names the option in the message ("argument --loss: ...").
Checks that involve several options call `parser.error`, which also prints one line.
"""
import argparse
import copy
import re

from .local_cluster import LocalCluster, RankFailed


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and ends the help of every option that takes a value and
    has a default with "(default: X)". Flags (store_true, store_false) get none: their default is
    "not given", and the value of their dest (True for --no-gloo) would mislead."""

    def _format_action(self, action):
        # argparse skips help it finds empty before any hook such as _get_help_string runs,
        # so the text goes in here, on a copy: the parser's own action stays as declared.
        if shows_default(action) and "(default:" not in (action.help or ""):
            action = copy.copy(action)
            action.help = f"{action.help or ''} (default: %(default)s)".lstrip()
        return super()._format_action(action)


def shows_default(action):
    """True for an option that takes a value and has a default worth printing."""
    return bool(action.option_strings) and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS, [])


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the shared help formatter, and errors as a single line: the usage that
    argparse prints first is one `--help` away, and two lines would bury what was wrong.
    Sub-parsers (the rig's) are made of this class too."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _convert(kind, text, what):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def integer(minimum, maximum=None):
    """type=: an int in [minimum, maximum]."""
    def parse(text):
        value = _convert(int, text, "an integer")
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {value}")
        return value
    return parse


def positive_number(text):
    """type=: a float above 0 (seconds, say)."""
    value = _convert(float, text, "a number")
    if not value > 0:  # written so that NaN fails too
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def fraction(one_allowed=True):
    """type=: a float in [0, 1], or [0, 1) where 1 makes no sense (a loss rate of 1 delivers nothing)."""
    interval = "[0, 1]" if one_allowed else "[0, 1)"

    def parse(text):
        value = _convert(float, text, "a number")
        if not (0 <= value <= 1 and (one_allowed or value < 1)):
            raise argparse.ArgumentTypeError(f"must be in {interval}, not {text}")
        return value
    return parse


def one_of(choices):
    """type= for a single item of a comma-separated list (plain options use choices=)."""
    def parse(text):
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {text!r} (choose from {', '.join(choices)})")
        return text
    return parse


def comma_separated(item):
    """type=: "a,b,c" as a list, each part read by `item` (spaces around parts are ignored)."""
    def parse(text):
        return [item(part.strip()) for part in text.split(",")]
    return parse


def matching(pattern, example):
    """type=: a string that fully matches the regular expression `pattern`."""
    compiled = re.compile(pattern)

    def parse(text):
        if not compiled.fullmatch(text):
            raise argparse.ArgumentTypeError(f"{text!r} does not look like {example}")
        return text
    return parse


def checked_by(check):
    """type=: the text as given when check(text) accepts it, else check's ValueError as the
    message, so that a rule the library already enforces is not written twice."""
    def parse(text):
        try:
            check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text
    return parse


def start_cluster(parser, world_size, **options):
    """LocalCluster(world_size, **options), or one error line when the ranks' init rejects a value
    that only the machine can judge (a --chunk-bytes larger than one datagram carries here)."""
    try:
        return LocalCluster(world_size, **options)
    except RankFailed as failure:
        if isinstance(failure.error, ValueError):
            parser.error(str(failure.error))
        raise
