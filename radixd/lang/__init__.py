"""radixd.lang: multi-call LLM programs as plain Python functions.

    from radixd.lang import function, system, user, assistant, gen, select, RuntimeEndpoint

    @function
    def qa(s, question):
        s += system("You answer briefly.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=32, temperature=0))

    state = qa.run(question="What is the capital of France?", backend=RuntimeEndpoint("http://127.0.0.1:8000"))
    print(state["answer"])
"""

from radixd.lang.backends import BackendError, EngineRuntime, RuntimeEndpoint
from radixd.lang.expr import (
           assistant,
           assistant_begin,
           assistant_end,
           gen,
           role_begin,
           role_end,
           select,
           system,
           user,
)
from radixd.lang.program import Program, function
from radixd.lang.state import ProgramError, ProgramState

__all__ = ["BackendError", "EngineRuntime", "Program", "ProgramError", "ProgramState", "RuntimeEndpoint",
           "assistant", "assistant_begin", "assistant_end", "function", "gen", "role_begin", "role_end", "select",
           "system", "user"]
