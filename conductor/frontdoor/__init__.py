"""What both front doors (`conductor gateway`, `conductor epp`) sit on: the OpenAI body, the tokenizer, the engine directory, the decider (README.md here)."""
