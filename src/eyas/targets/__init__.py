"""target/: the target: load it (HF, hub, GGUF), find its parts, tap aux layers; chats, masks."""
