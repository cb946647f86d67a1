"""llama.cpp itself: finding, probing and building its tools, the one launcher of its child processes, and the
libllama child tasks."""
