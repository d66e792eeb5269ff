"""Runtime models: the DeepSeek-V3 / Kimi target and the EAGLE-3 / 3.1 drafts."""
