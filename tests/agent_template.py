"""A chat template as agents' models have (Qwen's, Llama 3.1's): the tools' JSON written into the prompt
ahead of the conversation, assistant tool calls and tool results in it, and a `chat_template_kwargs`
variable (`persona`) that changes the system turn. Prompts rendered without the tools or the kwargs differ
from the start: the precise router must tokenize what the engine renders."""

AGENT_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% if persona is defined %}<|im_start|>persona\n{{ persona }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today and for the days ahead",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
