"""Tree-of-thought style search: fork several lines of reasoning from one shared prompt (the
branches run concurrently and share its KV through the radix cache), let the model judge
each branch with ``select``, and continue from the branches it judged sound.

    python examples/tree_of_thought.py --url http://127.0.0.1:8000
"""

import argparse

from radixd.lang import RuntimeEndpoint, assistant_begin, assistant_end, function, gen, select, user


@function
def tree_of_thought(s, question, width=3):
    s += user(question + "\nThink step by step.")
    s += assistant_begin() + "Let me consider a few approaches.\n"
    thoughts = s.fork(width)
    for i, t in enumerate(thoughts):
        t += f"Approach {i + 1}: " + gen("thought", max_tokens=48, temperature=0.8, seed=i, stop="\n")
        t += "\nIs this approach sound? " + select("verdict", choices=["yes", "no"])
    sound = [t for t in thoughts if t["verdict"] == "yes"] or thoughts
    best = sound[0]
    best += "\nSo the answer is: " + gen("answer", max_tokens=32, temperature=0, stop="\n")
    s += "Chosen approach: " + best["thought"] + "\nAnswer: " + best["answer"] + assistant_end()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    args = ap.parse_args()
    state = tree_of_thought.run(question="How many legs do three spiders and two cats have together?",
                                backend=RuntimeEndpoint(args.url))
    print(state.text())


if __name__ == "__main__":
    main()
