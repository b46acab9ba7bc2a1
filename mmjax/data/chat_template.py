"""Jinja chat templates rendered the way `transformers`' `apply_chat_template` renders them.

A chat template is untrusted code from a model folder, so it runs in jinja2's immutable sandbox with the
environment transformers builds: `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension,
`raise_exception`, a `tojson` that does not escape HTML, `strftime_now`, a restricted `dict` and
`namespace`, and the `{% generation %}` block tag, whose rendered character spans mark the assistant text
a model is trained on. Same template + same messages + same keyword arguments -> the same string.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mmjax.errors import DataError

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SPANS: contextvars.ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = contextvars.ContextVar(
    "mmjax_generation_spans", default=None)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and records the body's character span."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller: Any) -> str:
        text = caller()
        tracking = _SPANS.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text


class _TemplateDict:
    """`dict(...)` inside templates without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace without underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the attribute {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached per source string); a syntax error is a one-line DataError."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None


def has_generation_blocks(source: str) -> bool:
    return bool(_GENERATION_RE.search(source))


@functools.lru_cache(maxsize=32)
def reads_content_parts(source: str) -> bool:
    """True when the template loops over `message['content']` (typed parts: {"type": "text"|"image"}),
    as llava-hf's templates do; plain string content must then be given as parts."""
    template_ast = compile_template(source).environment.parse(source)
    for loop in template_ast.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
            node = node.node
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
            if node.arg.value == "content":
                return True
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
            return True
    return False


def render(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
           **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, character spans of `{% generation %}` blocks). Template errors (including the
    template's own `raise_exception`) are one-line DataErrors."""
    template = compile_template(source)
    kwargs = {"tools": None, "documents": None, **kwargs}  # apply_chat_template always passes both
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _SPANS.set((blocks, spans))
    try:
        for block in _generate(template, messages, add_generation_prompt, kwargs):
            blocks.append(block)
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"the chat template refused the conversation: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # e.g. str + list in the template
        raise DataError(f"the chat template failed on this conversation ({type(e).__name__}: {e}); check the "
                        "messages' roles and content types") from None
    finally:
        _SPANS.reset(token)
    return "".join(blocks), spans


def _generate(template: jinja2.Template, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
              kwargs: dict[str, Any]) -> Iterator[str]:
    yield from template.generate(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                 **kwargs)
