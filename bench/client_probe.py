"""What five OpenAI client libraries send to `lucebox serve`, each in its default and structured modes
with the standard fields that mean nothing to a local server set (metadata, store, service_tier,
prompt_cache_key, safety_identifier, user). Run by bench/client_libraries.py under a Python that has
the libraries (they are not lucebox dependencies); prints one JSON line per call: library, mode, ok,
and the answer or the error. Never imports lucebox.

Environment: LUCEBOX_URL (http://127.0.0.1:PORT), LUCEBOX_KEY, LUCEBOX_MODEL.
"""

from __future__ import annotations

import json
import os
import traceback

from pydantic import BaseModel

URL, KEY, MODEL = os.environ["LUCEBOX_URL"], os.environ["LUCEBOX_KEY"], os.environ["LUCEBOX_MODEL"]
BASE = URL + "/v1"
NO_OP = {"metadata": {"team": "probe"}, "store": False, "service_tier": "auto", "prompt_cache_key": "probe-1",
         "safety_identifier": "probe-user", "user": "probe-user"}
MESSAGES = [{"role": "user", "content": "def mean(xs):"}]
PROMPT = "def mean(xs):"


class Answer(BaseModel):
    ok: bool


def report(library: str, mode: str, call) -> None:
    try:
        answer = call()
        print(json.dumps({"library": library, "mode": mode, "ok": True, "answer": repr(answer)[:200]}), flush=True)
    except Exception as e:  # noqa: BLE001 - what the library raised is the finding
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        print(json.dumps({"library": library, "mode": mode, "ok": False, "error": last[:600]}), flush=True)


def probe_openai() -> None:
    from openai import OpenAI

    client = OpenAI(base_url=BASE, api_key=KEY, max_retries=0)
    report("openai", "default", lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, **NO_OP).choices[0].message.content)
    report("openai", "structured (json_schema)", lambda: client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, max_tokens=32, response_format=Answer, **NO_OP).choices[0].message.parsed)
    tool = {"type": "function", "function": {"name": "answer", "parameters": Answer.model_json_schema()}}
    report("openai", "structured (named tool)", lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=48, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "answer"}}, **NO_OP).choices[0].message.tool_calls[0])
    report("openai", "tools (auto)", lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=48, tools=[tool], **NO_OP).choices[0].message)
    report("openai", "tools (required, stream)", lambda: [
        c.choices[0].delta.tool_calls for c in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=96, tools=[tool], tool_choice="required", stream=True, **NO_OP)
        if c.choices and c.choices[0].delta.tool_calls][0])
    report("openai", "default (completions)", lambda: client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, user="probe-user").choices[0].text)


def probe_instructor() -> None:
    import instructor
    from openai import OpenAI

    for mode in ("TOOLS", "JSON"):
        client = instructor.from_openai(OpenAI(base_url=BASE, api_key=KEY, max_retries=0),
                                        mode=getattr(instructor.Mode, mode))
        report("instructor", f"structured ({mode})", lambda c=client: c.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=48, response_model=Answer, max_retries=0, **NO_OP))
    client = instructor.from_openai(OpenAI(base_url=BASE, api_key=KEY, max_retries=0))
    report("instructor", "default", lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, response_model=None, **NO_OP).choices[0].message.content)


def probe_langchain() -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=BASE, api_key=KEY, max_tokens=48, max_retries=0, service_tier="auto",
                     store=False, model_kwargs={"user": "probe-user", "metadata": NO_OP["metadata"],
                                                "prompt_cache_key": "probe-1", "safety_identifier": "probe-user"})
    report("langchain-openai", "default", lambda: llm.invoke(PROMPT).content)
    report("langchain-openai", "default (stream)", lambda: "".join(c.content for c in llm.stream(PROMPT)))
    report("langchain-openai", "tools (bind_tools)", lambda: llm.bind_tools([Answer]).invoke(PROMPT))
    for method in ("json_schema", "function_calling", "json_mode"):
        report("langchain-openai", f"structured ({method})",
               lambda m=method: llm.with_structured_output(Answer, method=m).invoke(PROMPT))


def probe_pydantic_ai() -> None:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIChatModelSettings
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE, api_key=KEY))
    settings = OpenAIChatModelSettings(max_tokens=48, openai_user="probe-user", openai_service_tier="auto",
                                       openai_prompt_cache_key="probe-1", extra_body={
                                           "metadata": NO_OP["metadata"], "store": False,
                                           "safety_identifier": "probe-user"})
    report("pydantic-ai", "default", lambda: Agent(model, model_settings=settings).run_sync(PROMPT).output)
    report("pydantic-ai", "structured (tool output)", lambda: Agent(
        model, output_type=Answer, model_settings=settings, retries=0, output_retries=0).run_sync(PROMPT).output)
    report("pydantic-ai", "structured (native output)", lambda: Agent(
        model, output_type=NativeOutput(Answer), model_settings=settings, retries=0,
        output_retries=0).run_sync(PROMPT).output)


def probe_litellm() -> None:
    import litellm

    common = {"model": f"openai/{MODEL}", "api_base": BASE, "api_key": KEY, "messages": MESSAGES, "num_retries": 0,
              **{k: v for k, v in NO_OP.items()}}
    report("litellm", "default", lambda: litellm.completion(max_tokens=8, **common).choices[0].message.content)
    report("litellm", "structured (json_schema)", lambda: litellm.completion(
        max_tokens=32, response_format=Answer, **common).choices[0].message.content)
    tool = {"type": "function", "function": {"name": "answer", "parameters": Answer.model_json_schema()}}
    report("litellm", "tools (auto)", lambda: litellm.completion(
        max_tokens=48, tools=[tool], **common).choices[0].message)
    report("litellm", "tools (required)", lambda: litellm.completion(
        max_tokens=96, tools=[tool], tool_choice="required", **common).choices[0].message.tool_calls[0])


if __name__ == "__main__":
    for probe in (probe_openai, probe_instructor, probe_langchain, probe_pydantic_ai, probe_litellm):
        try:
            probe()
        except ImportError as e:
            print(json.dumps({"library": probe.__name__[6:], "mode": "import", "ok": False, "error": str(e)}))
