"""Anthropic-API clients against a running cadence-serve: LangChain's ChatAnthropic (invoke,
stream, a forced tool, a tool result given back, structured output) and the anthropic SDK's
stream and count_tokens. Usage: python clients.py [BASE_URL]"""

import sys
import time

import httpx
from langchain_anthropic import ChatAnthropic
from langchain_core.tools import tool
import anthropic
from pydantic import BaseModel

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8765"
for _ in range(120):
    if httpx.get(f"{base}/health").status_code == 200: break
    time.sleep(2)
llm = ChatAnthropic(model="smollm2-135m", base_url=base, api_key="unused", max_tokens=40, temperature=0)
r = llm.invoke("What is the capital of France? Answer in one word.")
print("invoke:", repr(r.content), r.response_metadata.get("stop_reason"), r.usage_metadata)
chunks = list(llm.stream("Name three colors."))
print("stream:", repr("".join(c.content if isinstance(c.content, str) else "".join(b.get("text", "") for b in c.content) for c in chunks)))

@tool
def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"

bound = llm.bind_tools([get_weather], tool_choice="get_weather")
r = bound.invoke("What's the weather in Paris?")
print("tool:", r.tool_calls, r.response_metadata.get("stop_reason"))
# give the result back
from langchain_core.messages import HumanMessage, ToolMessage
msgs = [HumanMessage("What's the weather in Paris?"), r, ToolMessage("sunny, 21C", tool_call_id=r.tool_calls[0]["id"])]
r2 = llm.bind_tools([get_weather]).invoke(msgs)
print("after tool:", repr(r2.content)[:200], r2.response_metadata.get("stop_reason"))

class City(BaseModel):
    name: str
    country: str
s = llm.with_structured_output(City).invoke("Paris is the capital of France. Extract the city.")
print("structured:", s)

c = anthropic.Anthropic(base_url=base, api_key="unused")
with c.messages.stream(model="smollm2-135m", max_tokens=60, messages=[{"role": "user", "content": "Write a haiku."}], system="You are a poet.") as st:
    text = "".join(st.text_stream)
    final = st.get_final_message()
print("sdk stream:", repr(text), final.stop_reason, final.usage)
print("count:", c.messages.count_tokens(model="smollm2-135m", messages=[{"role": "user", "content": "Write a haiku."}], system="You are a poet."))
