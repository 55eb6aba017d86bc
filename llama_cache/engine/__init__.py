"""The serving engine: one llama.cpp context, many sequences, continuous batching, shared prefix cells.

Modules, one idea each: :mod:`.model` (the GGUF's weights, vocabulary and chat template),
:mod:`.context` (the llama.cpp context, its batch, its memory and per-sequence state),
:mod:`.residency` (which sequence holds which tokens, and the cells they take), :mod:`.sampling`
(a sequence's sampler chain), :mod:`.text` (stop sequences), :mod:`.scheduler` (the step loop),
:mod:`.completions` (llama-cpp-python's completion API per request), :mod:`.requests` (a program's
submitted completion) and :mod:`.engine` (the assembly). The public names are exported by
:mod:`llama_cache`.
"""
