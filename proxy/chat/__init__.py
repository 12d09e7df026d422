"""Messages, chat-template rendering and tool-call parsing: the only place that turns
messages into tokens and tokens back into messages."""
