"""Front doors: the offline Engine, the HTTP server (SGLang native + OpenAI APIs)."""
