"""A multi-turn chat as a radixd.lang program: each turn's prompt extends the last one, so the
radix cache serves the conversation so far and only the new turn is computed.

    radixd --config radixd.toml &          # or any radixd daemon
    python examples/multi_turn_chat.py --url http://127.0.0.1:8000
"""

import argparse

from radixd.lang import RuntimeEndpoint, assistant, function, gen, system, user


@function
def multi_turn(s, questions):
    s += system("You are a helpful assistant. Answer in one sentence.")
    for i, q in enumerate(questions):
        s += user(q)
        s += assistant(gen(f"answer_{i}", max_tokens=48, temperature=0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    args = ap.parse_args()
    questions = ["What is the capital of France?", "And its largest museum?", "When did it open?"]
    state = multi_turn.run(questions=questions, backend=RuntimeEndpoint(args.url))
    for i, q in enumerate(questions):
        meta = state.get_meta_info(f"answer_{i}")
        print(f"Q: {q}\nA: {state[f'answer_{i}']}  (cached prompt tokens: {meta['cached_tokens']})\n")


if __name__ == "__main__":
    main()
