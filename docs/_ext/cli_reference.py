"""``{cli-reference}``: the ``dramatiq-pg-broker`` command, generated from its parser.

It walks :func:`dramatiq_pg_broker.cli.build_parser` (the same parser the command runs),
so every command, argument, choice and default shown is the one the code accepts. One
section per command that runs something, with its usage line and its arguments.
"""

from __future__ import annotations

import argparse

from docnodes import paragraph, section
from docutils import nodes
from sphinx.util.docutils import SphinxDirective

from dramatiq_pg_broker.cli import build_parser


def _subcommands(parser: argparse.ArgumentParser):
    """(name, help, parser) of each subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name) or "", sub


def _arguments(parser: argparse.ArgumentParser) -> nodes.Node | None:
    items = nodes.definition_list()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            term = ", ".join(action.option_strings)
            if action.nargs != 0:
                term += f" {action.metavar or action.dest.upper()}"
        else:
            term = action.metavar or action.dest
        text = action.help or ""
        if text:
            text = text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")
        if action.choices and not isinstance(action.choices, dict):
            text += f" One of: {', '.join(f'`{c}`' for c in action.choices)}."
        if action.required and action.option_strings:
            text += " Required."
        if action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
            text += f" Default: `{action.default}`."
        item = nodes.definition_list_item()
        item += nodes.term("", "", nodes.literal(term, term))
        definition = nodes.definition()
        definition += paragraph(text.strip() or "(no description)")
        item += definition
        items += item
    return items if len(items) else None


class CliReference(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        parser = build_parser()
        result: list[nodes.Node] = []
        top = section(self.state.document, "Global options")
        top += paragraph(
            "Given before the command or after it: `dramatiq-pg-broker --url URL jobs list` "
            "or `dramatiq-pg-broker jobs list --url URL`. Every command also takes `--json`: "
            "its output, and its errors on stderr, as JSON."
        )
        top += nodes.literal_block(text=parser.format_usage().strip(), language="text")
        top += _arguments(parser)
        result.append(top)
        self._walk(parser, "dramatiq-pg-broker", result)
        return result

    def _walk(self, parser, prog: str, result: list[nodes.Node]) -> None:
        for name, help_text, sub in _subcommands(parser):
            command = f"{prog} {name}"
            nested = list(_subcommands(sub))
            if nested:
                self._walk(sub, command, result)
                continue
            part = section(self.state.document, command, code=True)
            if help_text:
                part += paragraph(help_text[0].upper() + help_text[1:] + ".")
            part += nodes.literal_block(text=sub.format_usage().strip(), language="text")
            arguments = _arguments(sub)
            if arguments is not None:
                part += arguments
            result.append(part)


def setup(app):
    app.add_directive("cli-reference", CliReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
