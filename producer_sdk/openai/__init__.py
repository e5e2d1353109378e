"""OpenAI's shapes, shared by the gateway and the batch runner: request and response bodies
(``format``), logprobs objects (``logprobs``), tool calls (``tool_calls``) and every spelling of
an output constraint (``structured``)."""
