"""Worker-side execution: dispatching transfers between the KV cache and the host backend."""
