"""The engine: the loop thread (schedule -> execute -> commit), AsyncEngine for servers and
LLM for offline use. Only the engine thread touches the Rust Core."""
