"""serve/: serving: the vLLM plugin, OpenAI client/server, speculative decoding, its report."""
