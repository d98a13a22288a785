"""The sandbox a request's own chat template renders in (``--trust-request-chat-template``), with
bounds on what one render may build (issue 37 item 3).

Jinja's sandbox keeps a template away from Python's internals, not from the machine: ``7 **
30000000`` is one C operation that holds the interpreter for tens of seconds, ``'a' * 10**10``
asks for 40 GB, ``[x, x]`` doubled in a loop makes a value whose text is exponential, and the
line tracer of engine/bounded_render.py cannot stop any of them. Here every way a template can
make a large value is intercepted and refused past a bound, before the value is built:

- arithmetic and sequence operators (``**``, ``*``, ``+``, ``%``: the sandbox's
  ``intercepted_binops``): integers stay under ``MAX_INT_BITS``, strings and lists under
  ``MAX_SIZE``;
- ``~`` and list / tuple / dict literals (the code generator): their text under ``MAX_SIZE``;
- filters and calls (``center``, ``indent``, ``join``, ``replace``, ``format``, ``str.ljust``,
  ``str.format``...): width and count arguments under ``MAX_INT_ARG``, what they would build
  estimated first, and every result measured;
- what a value would print as is measured before it is printed or joined (``finalize``): the
  "text size" of a value counts every element of its containers, so a value cannot hold more
  text than ``MAX_SIZE`` however its parts are shared; sizes are remembered per object for the
  render, so measuring a value built from measured parts costs its own length;
- the rendered text and every block buffer (``concat``) are joined only up to ``MAX_SIZE``;
- all of it draws on one budget of ``FUEL`` units per render (characters built, elements
  measured): a loop that rebuilds large values runs out of it.

Filters that are slow or superlinear in C or pure Python and no chat template needs
(``pprint``, ``striptags``, ``urlize``, ``wordwrap``) and the ``lipsum`` global are left out.
Loop iterations and the deadline are bounded by the line tracer (``MAX_TEMPLATE_LINES`` in
engine/bounded_render.py). Past any bound the render raises ``TemplateLimitError``, a
``TemplateError``: the request gets a 400 naming the bound.
"""
from __future__ import annotations

import re
import threading
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from contextlib import contextmanager
from typing import Any

from jinja2.compiler import CodeGenerator
from jinja2.exceptions import TemplateError
from jinja2.runtime import Macro, Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import pass_context

MAX_SIZE = 1 << 22  # characters of text (or elements) one value, or the rendered prompt, may hold
MAX_INT_BITS = 1 << 16  # an integer's size (about 19,700 digits)
MAX_INT_ARG = 1 << 20  # a width, count or repeat given to a filter or a call
FUEL = 1 << 26  # work units of one render: characters built and elements measured
_JSON_INDENT = 16  # the most tojson(indent=...) may indent a level

_SMALL = 64  # the text size of an object that prints as a short fixed string (a macro, Undefined)
_REMOVED_FILTERS = ("pprint", "striptags", "urlize", "wordwrap")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_NUMBERS = re.compile(r"\d+")


class TemplateLimitError(TemplateError):
    """A request's chat template asked for more than the sandbox allows."""


class _Budget:
    __slots__ = ("fuel", "sizes")

    def __init__(self) -> None:
        self.fuel = FUEL
        # id -> (the object, its text size): the object is kept so that its id is not reused
        self.sizes: dict[int, tuple[Any, int]] = {}

    def spend(self, units: int) -> None:
        self.fuel -= units
        if self.fuel < 0:
            raise TemplateLimitError(f"the chat template did more work than this server allows one "
                                     f"render ({FUEL:,} units of building and measuring values)")


_local = threading.local()


def _budget() -> _Budget:
    b = getattr(_local, "budget", None)
    if b is None:  # outside render(): compile-time folding of constants
        b = _local.budget = _Budget()
    return b


def _too_big(what: str, size: int, limit: int = MAX_SIZE, unit: str = "characters") -> TemplateLimitError:
    return TemplateLimitError(f"the chat template would build {what} of {size:,} {unit}; this server "
                              f"allows {limit:,}")


# ---- how much text a value holds ------------------------------------------------------------------


def text_size(value: Any, limit: int = MAX_SIZE) -> int:
    """About how many characters ``str(value)`` holds, counting every element of a container
    (shared ones as often as they are shared); raises past ``limit``. Sizes of immutable
    containers are remembered for the render, so a container of measured parts costs its length."""
    budget = _budget()
    size = _measure(value, budget, limit, set())
    if size > limit:
        raise _too_big("a value printing as text", size, limit)
    return size


def _measure(value: Any, budget: _Budget, limit: int, active: set[int]) -> int:
    """The text size, stopping soon after it passes ``limit``; 'mutable' containers (those that
    hold a namespace, whose attributes templates assign) are not remembered."""
    if isinstance(value, str):
        return len(value)
    if value is None or isinstance(value, (bool, float)):
        return 8
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    if isinstance(value, (bytes, bytearray)):
        return 4 * len(value)
    key = id(value)
    known = budget.sizes.get(key)
    if known is not None:
        return known[1]
    if key in active:
        return _SMALL  # a cycle prints as "[...]"
    if isinstance(value, Namespace):
        items: Any = object.__getattribute__(value, "_Namespace__attrs").items()
        remember = False
    elif isinstance(value, dict):
        items, remember = value.items(), True
    elif isinstance(value, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
        items, remember = value, isinstance(value, (list, tuple, frozenset))
    else:
        return _SMALL  # functions, macros, Undefined, loop contexts, generators: a short repr
    active.add(key)
    try:
        size = 2
        steps = 0
        for item in items:
            steps += 1
            if isinstance(item, tuple) and len(item) == 2 and not isinstance(value, (list, tuple)):
                size += _measure(item[0], budget, limit, active) + _measure(item[1], budget, limit, active) + 4
            else:
                size += _measure(item, budget, limit, active) + 2
            if size > limit:
                break
        budget.spend(steps + 1)
    finally:
        active.discard(key)
    if remember and size <= limit and not _holds_namespace(value, budget):
        budget.sizes[key] = (value, size)
    return size


def _holds_namespace(value: Any, budget: _Budget) -> bool:
    """Whether a container holds a namespace (its text can grow after it is measured)."""
    stack, seen = [value], set()
    steps = 0
    while stack:
        v = stack.pop()
        if isinstance(v, Namespace):
            return True
        if id(v) in seen or id(v) in budget.sizes:
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, frozenset)):
            stack.extend(v)
        steps += 1
    budget.spend(steps)
    return False


def _checked(value: Any) -> Any:
    """A value the template made: measured (and remembered), and its size spent."""
    size = text_size(value)
    _budget().spend(size if isinstance(value, str) else 1)
    return value


def _made_of(result: Any, size: int, *parts: Any) -> Any:
    """``result``, a list or tuple built of ``parts`` (``+``, ``*``) whose text size is known to
    be ``size``: remembered without walking it again when every part was remembered (none holds a
    namespace); measured otherwise."""
    budget = _budget()
    if isinstance(result, (list, tuple)) and all(id(p) in budget.sizes for p in parts):
        budget.sizes[id(result)] = (result, size)
        budget.spend(1)
        return result
    return _checked(result)


def _int_args(name: str, args: tuple, kwargs: dict) -> int:
    """The largest integer argument (widths, counts); refused past MAX_INT_ARG."""
    largest = 0
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool):
            if abs(v) > MAX_INT_ARG:
                raise TemplateLimitError(f"the chat template passed {v} to {name}; this server allows "
                                         f"widths and counts up to {MAX_INT_ARG:,}")
            largest = max(largest, abs(v))
    return largest


# ---- estimates of what an operation would build ----------------------------------------------------


def _percent_size(fmt: str, args: Any, what: str) -> int:
    """An upper bound of ``fmt % args``'s length."""
    specs = 0
    for m in _PERCENT_SPEC.finditer(fmt):
        specs += 1
        for part in m.groups():
            if part == "*":
                raise TemplateLimitError(f"{what}: '*' widths are not allowed in a chat template")
            if part is not None and int(part) > MAX_INT_ARG:
                raise TemplateLimitError(f"{what}: a width of {part} is more than this server allows "
                                         f"({MAX_INT_ARG:,})")
    widest = max((int(p) for m in _PERCENT_SPEC.finditer(fmt) for p in m.groups() if p), default=0)
    if isinstance(args, tuple):  # each conversion takes the next one
        values = sum(text_size(v) for v in args)
    elif isinstance(args, dict):  # a key may be named again and again
        values = specs * max((text_size(v) for v in args.values()), default=0)
    else:
        values = text_size(args)
    return len(fmt) + values + specs * widest


def _format_size(fmt: str, args: tuple, kwargs: dict) -> int:
    """An upper bound of ``fmt.format(*args, **kwargs)``'s length."""
    widest = max((int(n) for n in _BRACE_NUMBERS.findall(fmt)), default=0)
    if widest > MAX_INT_ARG:
        raise TemplateLimitError(f"str.format: a width of {widest} is more than this server allows "
                                 f"({MAX_INT_ARG:,})")
    widest = max(widest, _int_args("str.format", args, kwargs))
    largest = max((text_size(v) for v in (*args, *kwargs.values())), default=0)
    return len(fmt) + fmt.count("{") * (largest + widest)


def _replace_size(s: str, old: str, new: str, count: int = -1) -> int:
    n = len(s) + 1 if old == "" else s.count(old)
    if count is not None and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def _join_size(items: list, sep: str) -> int:
    return sum(text_size(v) for v in items) + max(0, len(items) - 1) * len(sep)


def _str_method_size(s: str, name: str, args: tuple, kwargs: dict) -> int | None:
    """What a method of a string would build (None: at most what it reads)."""
    largest = _int_args(f"str.{name}", args, kwargs)
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(len(s), largest)
    if name == "expandtabs":
        return len(s) + s.count("\t") * max(1, largest or 8)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return _replace_size(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    if name in ("format", "format_map"):
        return _format_size(s, args, kwargs if name == "format" else dict(args[0]) if args else {})
    if name == "translate" and args and isinstance(args[0], dict):
        return len(s) * max([1] + [text_size(v) for v in args[0].values()])
    return None


# ---- the environment ------------------------------------------------------------------------------


class _BoundedCodeGenerator(CodeGenerator):
    """``~`` and list / tuple / dict literals go through the environment's measuring."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_List(self, node, frame) -> None:
        self.write("environment.bounded_value(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node, frame) -> None:
        self.write("environment.bounded_value(")
        super().visit_Dict(node, frame)
        self.write(")")

    def visit_Tuple(self, node, frame) -> None:
        if node.ctx != "load":  # an assignment target
            super().visit_Tuple(node, frame)
            return
        self.write("environment.bounded_value(")
        super().visit_Tuple(node, frame)
        self.write(")")


def _bounded_concat(pieces: Any) -> str:
    """Join output pieces (the rendered prompt, a block's or macro's buffer) up to MAX_SIZE."""
    out: list[str] = []
    size = 0
    for piece in pieces:
        size += len(piece)
        if size > MAX_SIZE:
            raise _too_big("a text", size)
        out.append(piece)
    _budget().spend(size)
    return "".join(out)


def _wrap_filter(name: str, func: Any) -> Any:
    """A filter that checks its arguments first and measures its result (as a context filter:
    Jinja then never runs it while compiling, outside a render's budget)."""
    from jinja2.utils import _PassArg

    passing = _PassArg.from_obj(func)

    @pass_context
    def bounded(context, value, *args, **kwargs):
        value, args, kwargs = _check_filter(name, value, args, kwargs)
        if passing is _PassArg.context:
            result = func(context, value, *args, **kwargs)
        elif passing is _PassArg.eval_context:
            result = func(context.eval_ctx, value, *args, **kwargs)
        elif passing is _PassArg.environment:
            result = func(context.environment, value, *args, **kwargs)
        else:
            result = func(value, *args, **kwargs)
        return _checked(result)

    bounded.__name__ = name
    return bounded


def _check_filter(name: str, value: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """Refuse a filter call that would build more than the bounds (before it runs)."""
    _int_args(f"the {name} filter", args, kwargs)
    for v in (value, *args, *kwargs.values()):
        text_size(v)
    estimate = None
    if name == "join":
        value = list(value) if not isinstance(value, (list, tuple, str)) else value
        sep = args[0] if args else kwargs.get("d", "")
        estimate = _join_size(list(value), sep if isinstance(sep, str) else "")
    elif name == "replace" and isinstance(value, str) and len(args) >= 2:
        if isinstance(args[0], str) and isinstance(args[1], str):
            count = args[2] if len(args) > 2 else kwargs.get("count")
            estimate = _replace_size(value, args[0], args[1], count if isinstance(count, int) else -1)
    elif name == "indent" and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", 4)
        per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 4
        estimate = len(value) + (value.count("\n") + 1) * per_line
    elif name == "format" and isinstance(value, str):
        estimate = _percent_size(value, kwargs if kwargs else tuple(args), "the format filter")
    elif name == "tojson":
        indent = args[0] if args else kwargs.get("indent")
        if isinstance(indent, int) and indent > _JSON_INDENT:
            raise TemplateLimitError(f"tojson(indent={indent}): this server allows up to {_JSON_INDENT}")
    elif name == "sum":
        start = args[1] if len(args) > 1 else kwargs.get("start", 0)
        if not isinstance(start, (int, float)):
            raise TemplateLimitError("the sum filter takes numbers only in a chat template")
    if estimate is not None and estimate > MAX_SIZE:
        raise _too_big(f"a text (the {name} filter)", estimate)
    return value, args, kwargs


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with bounds on what a template may build (module docstring)."""

    intercepted_binops = frozenset({"**", "*", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=self._finalize, **options)
        self.globals.pop("lipsum", None)
        self.concat = _bounded_concat  # the rendered text and every buffer of output

    def prepare(self) -> None:
        """Wrap the filters once the caller has added its own (tojson, ...)."""
        for name in _REMOVED_FILTERS:
            self.filters.pop(name, None)
        for name, func in list(self.filters.items()):
            self.filters[name] = _wrap_filter(name, func)

    @staticmethod
    @pass_context
    def _finalize(context, value: Any) -> Any:
        text_size(value)  # what {{ value }} would print
        return value

    def bounded_join(self, values: tuple) -> str:
        """``a ~ b``: measured before it is built."""
        size = sum(text_size(v) for v in values)
        if size > MAX_SIZE:
            raise _too_big("a text", size)
        _budget().spend(size)
        return "".join(map(str, values))

    def bounded_value(self, value: Any) -> Any:
        """A list, tuple or dict literal."""
        return _checked(value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        ints = isinstance(left, int) and isinstance(right, int)
        made: tuple | None = None  # (text size of the result, the containers it is made of)
        if operator == "**":
            if ints and right > 0 and abs(left) > 1:
                bits = right * max(1, abs(left).bit_length() - 1)
                if bits > MAX_INT_BITS:
                    raise _too_big("an integer", bits, MAX_INT_BITS, "bits")
        elif operator == "*":
            if ints:
                bits = left.bit_length() + right.bit_length()
                if bits > MAX_INT_BITS:
                    raise _too_big("an integer", bits, MAX_INT_BITS, "bits")
            else:
                seq, times = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(times, int) and not isinstance(seq, (int, float)) and times > 0:
                    one = text_size(seq)
                    size = one * times
                    if size > MAX_SIZE:
                        raise _too_big("a sequence printing as text", size)
                    made = (2 + (one - 2) * times, seq)
        elif operator == "+":
            if not ints and not isinstance(left, (int, float)):
                size = text_size(left) + text_size(right)
                if size > MAX_SIZE:
                    raise _too_big("a sequence printing as text", size)
                made = (size - 2, left, right)
        elif operator == "%" and isinstance(left, str):
            size = _percent_size(left, right, "'%' formatting")
            if size > MAX_SIZE:
                raise _too_big("a text ('%' formatting)", size)
        result = self.binop_table[operator](left, right)
        if made is not None:
            return _made_of(result, *made)
        if not isinstance(result, (int, float)):
            _checked(result)
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if not isinstance(__obj, Macro):  # a template's own macro: its arguments are just bound
            target = getattr(__obj, "__wrapped__", __obj)  # str.format, as the sandbox wraps it
            name = getattr(target, "__name__", "a function")
            owner = getattr(target, "__self__", None)
            if isinstance(owner, str):
                if name == "join" and args and not isinstance(args[0], (list, tuple, str)):
                    args = (list(args[0]), *args[1:])
                estimate = _join_size(list(args[0]), owner) if name == "join" and args else \
                    _str_method_size(owner, name, args, kwargs)
                if estimate is not None and estimate > MAX_SIZE:
                    raise _too_big(f"a text (str.{name})", estimate)
            else:
                _int_args("range" if name == "safe_range" else name, args, kwargs)
            for v in (*args, *kwargs.values()):
                text_size(v)
        return _checked(super().call(__context, __obj, *args, **kwargs))


@contextmanager
def render_budget() -> Iterator[_Budget]:
    """``with render_budget():`` around one render: a fresh budget for this thread."""
    previous = getattr(_local, "budget", None)
    _local.budget = _Budget()
    try:
        yield _local.budget
    finally:
        _local.budget = previous
