"""Tool calling, shared by the chat session (`LLM.chat(tools=...)`) and the server: OpenAI's
`tools`, `tool_choice` and `parallel_tool_calls` checked into a `ToolRequest` (`request`), the tools
rendered into the prompt (`prompt`), and the calls read back out of an answer as it streams
(`answer`). The call syntaxes and their parsers are `lucebox.text.tool_calls`; the grammar that
constrains calls is `lucebox.constrained.tool_grammar`."""

from lucebox.text.tool_calls import ToolCall
from lucebox.tools.answer import ToolCallStream
from lucebox.tools.prompt import model_tool_format, prompt_parts
from lucebox.tools.request import CONSTRAINED_CALLS, ToolRequest, check_tools

__all__ = ["CONSTRAINED_CALLS", "ToolCall", "ToolCallStream", "ToolRequest", "check_tools", "model_tool_format",
           "prompt_parts"]
