"""Structured extraction: product name, price, features and a sentiment score from a product
description, generated under a JSON Schema (every output parses and validates).

    python examples/json_extraction.py --url http://127.0.0.1:8000
"""

import argparse
import json

from radixd.lang import RuntimeEndpoint, assistant, function, gen, system, user

PRODUCT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "price": {"type": "number", "minimum": 0},
        "features": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1, "maxItems": 4},
        "sentiment": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["name", "price", "features", "sentiment"],
    "additionalProperties": False,
}

DESCRIPTIONS = [
    "The Aurora X2 headphones cost $149.99. They have active noise cancelling, 30 hours of battery "
    "and a foldable design. Reviewers love the sound but find them a little heavy.",
    "For just 12 euros, the SnapCup travel mug keeps coffee hot for 6 hours and is dishwasher safe. "
    "The lid leaks sometimes, which annoyed many buyers.",
]


@function
def extract(s, description):
    s += system("You extract product facts as JSON.")
    s += user("Product description:\n" + description + "\nReturn name, price, features and a 1-5 sentiment score.")
    s += assistant(gen("facts", max_tokens=160, temperature=0, json_schema=PRODUCT_SCHEMA))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    args = ap.parse_args()
    states = extract.run_batch([{"description": d} for d in DESCRIPTIONS], backend=RuntimeEndpoint(args.url))
    for st in states:
        print(json.dumps(json.loads(st["facts"]), indent=2))


if __name__ == "__main__":
    main()
