"""The command line's help formatting and parser: help by paragraph, defaults shown, the
closest valid choice named on a mistyped one."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Formatter", "Parser", "unknown_choice"]


class Formatter(argparse.HelpFormatter):
    """Descriptions and epilogs by paragraph (blank-line separated): a paragraph with an
    indented line (a list, example commands) is kept as written, the others are filled to
    the terminal's width. Each option's help ends with its default unless it says the
    default itself or has none to show."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        # Not at hyphens: names such as static-sequential and --no-live stay whole.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        paragraphs = []
        for paragraph in text.strip("\n").split("\n\n"):
            if paragraph.startswith(" ") or "\n " in paragraph:
                paragraphs.append(textwrap.indent(paragraph, indent))
            else:
                words = " ".join(paragraph.split())
                paragraphs.append(
                    textwrap.fill(
                        words,
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                        break_on_hyphens=False,
                    )
                )
        return "\n\n".join(paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.option_strings
            and action.default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too) adding the closest valid choice to an
    invalid-choice error (a command, --task, --mode)."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            choices = [str(choice) for choice in action.choices or ()]
            close = difflib.get_close_matches(str(value), choices, n=1)
            if not close:
                raise
            raise argparse.ArgumentError(
                action, f"{exc.message} (did you mean {close[0]}?)"
            ) from None


def unknown_choice(
    what: str,
    name: str,
    valid: Iterable[str],
    *,
    plural: str = "",
    listed: str = "",
    close: Sequence[str] = (),
) -> str:
    """An unknown choice: the valid ones and, when some are close (``close``, else the
    closest of ``valid``), a suggestion. ``listed`` replaces the list of ``valid``."""
    options = list(valid)
    close = close or difflib.get_close_matches(name, options, n=1)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    listed = listed or ", ".join(options)
    return f"unknown {what} {name!r}{hint}; valid {plural or what + 's'}: {listed}"
