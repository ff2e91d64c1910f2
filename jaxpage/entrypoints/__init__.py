"""How users reach the engine: LLM, the `jaxpage` command, the OpenAI server, batch jobs, the
async engine, metrics, and a process that follows process 0 on several hosts."""
