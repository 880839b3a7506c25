"""The jinja2 environment chat templates render in: transformers' setup (so prompts come out the
same as there) inside an immutable sandbox (no attribute escapes, no changes to lists and dicts),
where every step that can build a value is bounded (template_limits.py has the scheme):

- every binary operator (`+ - * / // % **`) goes through `call_binop`;
- `~` and the text a block builds (`{% set x %}...{% endset %}`, a macro's or caller's body) go
  through `concat` (the code generator writes `environment.concat` where jinja writes its own join);
- every call (a method, a macro, a global) goes through `call`; every filter is wrapped;
- every list, tuple or dict the template writes out (`[a, b]`) goes through `checked`;
- every `{{ value }}` goes through `finalize` before it becomes text;
- every piece of text written, to the output (`render_counted`) or into a macro's, call block's or
  set block's buffer (a WrittenText where jinja makes a list), counts in the render's running total.
Each one estimates a result that multiplies its inputs before it runs (template_growth.py) and
checks what it made after. The time is bounded by chat_template.py.
"""

from __future__ import annotations

import functools
import inspect
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from lucebox.text.template_growth import binop_growth, call_growth, check_int_arguments, filter_growth
from lucebox.text.template_limits import WrittenText, checked, counting_written_text, refuse_over, text_length


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    def visit_Concat(self, node, frame) -> None:  # noqa: N802 (jinja's visitor name)
        """`a ~ b ~ c` as environment.concat((a, b, c)), where jinja writes its unbounded str_join
        (this environment never autoescapes, so jinja's markup_join is never needed)."""
        self.write("environment.concat((")
        for operand in node.nodes:
            self.visit(operand, frame)
            self.write(", ")
        self.write("))")

    def buffer(self, frame) -> None:
        """A macro's, call block's or set block's pieces collect in a WrittenText, where jinja uses a
        list: each piece counts in the render's running total as it is written, not when joined."""
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.written_text()")

    def visit_List(self, node, frame) -> None:  # noqa: N802 (jinja's visitor names)
        self._write_checked(super().visit_List, node, frame)

    def visit_Dict(self, node, frame) -> None:  # noqa: N802
        self._write_checked(super().visit_Dict, node, frame)

    def visit_Tuple(self, node, frame) -> None:  # noqa: N802
        if node.ctx != "load":  # the names an assignment or a loop unpacks into
            super().visit_Tuple(node, frame)
        else:
            self._write_checked(super().visit_Tuple, node, frame)

    def _write_checked(self, visit, node, frame) -> None:
        """A list, tuple or dict written out in the template (`[ns.x, ns.x]` doubles what it holds)
        measured as every other value a template builds."""
        self.write("environment.checked(")
        visit(node, frame)
        self.write(")")


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() with a short repr: the default writes every value it holds, so
    `{{ ns }}` could print a structure far larger than it is without any step seeing it."""

    def __repr__(self) -> str:
        return "<Namespace>"


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(jinja2.sandbox.SandboxedEnvironment.default_binop_table)
    checked = staticmethod(checked)  # for the code generator's lists, tuples and dicts
    written_text = WrittenText  # for its buffers

    def concat(self, values) -> str:
        """The text of `values` side by side (`~`, and what a block or macro writes)."""
        values = list(values)
        refuse_over(sum(text_length(v) for v in values), what="text")
        return "".join(map(str, values))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        binop_growth(operator, left, right)
        return checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        args = call_growth(__obj, args, kwargs)
        return checked(super().call(__context, __obj, *args, **kwargs))


def render_counted(template: jinja2.Template, variables: dict) -> str:
    """`template`'s output, every piece it writes (buffers too) counted in one running total."""
    with counting_written_text():
        output = WrittenText()
        output.extend(template.generate(variables))
        return "".join(output)


def _finalize(value: Any) -> Any:
    """What `{{ value }}` writes, measured before str() writes it."""
    refuse_over(text_length(value), what="text")
    return value


def _bounded_filter(name: str, f):
    """The filter `f` with its arguments checked before it runs and its result after."""
    signature = inspect.signature(f)  # for jinja's sync/async filters, the sync function's
    declared = getattr(inspect.unwrap(f), "jinja_pass_arg", None) is not None  # it lists a context first
    lead = 1 if getattr(f, "jinja_pass_arg", None) is not None and not declared else 0  # passed, not listed
    value_name = list(signature.parameters)[int(declared)]

    @functools.wraps(f)  # keeps jinja's pass_context/pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args[lead:], **kwargs)
        check_int_arguments(call.args[int(declared) + 1:], call.kwargs)
        filter_growth(name, value_name, call.arguments)
        return checked(f(*args[:lead], *call.args, **call.kwargs))

    return bounded


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    """jinja's format filter (`"%s, %s"|format(a, b)`) as transformers' jinja has it."""
    return str(value) % (kwargs or args)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and '; templates expect plain JSON, as transformers gives them
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def bounded_environment() -> BoundedSandbox:
    """The environment transformers builds for chat templates (they come from the Hub, hence the
    sandbox), with every step bounded."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                         finalize=_finalize)
    env.filters.update({"format": _format, "tojson": _tojson})
    env.filters.update({name: _bounded_filter(name, f) for name, f in env.filters.items()})
    env.globals.update({"raise_exception": _raise_exception, "namespace": _Namespace,
                        "strftime_now": lambda fmt: datetime.now().strftime(fmt)})
    return env
