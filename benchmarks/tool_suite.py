"""The tool-calling suite: 32 OpenAI function tools (nested objects, enums, arrays, optional
fields, numbers with bounds), each with a user request that calls for it.

Used by tests/test_tool_calls.py and benchmarks/tool_calls.py.
"""

from __future__ import annotations

S = {"type": "string"}
INT = {"type": "integer"}
N = {"type": "number"}
B = {"type": "boolean"}


def obj(props: dict, required=None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


def rng(kind: str, lo, hi) -> dict:
    return {"type": kind, "minimum": lo, "maximum": hi}


def enum(*values) -> dict:
    return {"type": "string", "enum": list(values)}


def arr(items: dict, lo: int = 0, hi: int | None = None) -> dict:
    return {"type": "array", "items": items, "minItems": lo, **({"maxItems": hi} if hi is not None else {})}


# name -> (description, parameters, a request that calls for it)
FUNCTIONS: dict[str, tuple[str, dict, str]] = {
    "get_weather": ("Current weather in a city", obj({"city": S, "unit": enum("celsius", "fahrenheit")}, ["city"]),
                    "What's the weather in Paris in celsius?"),
    "add": ("Add two integers", obj({"a": INT, "b": INT}), "What is 17 plus 25?"),
    "set_thermostat": ("Set a thermostat", obj({"temperature": rng("number", 5, 35), "room": S}, ["temperature"]),
                       "Set the living room to 21.5 degrees."),
    "book_flight": ("Book a flight", obj({"origin": {"type": "string", "minLength": 3, "maxLength": 3},
                                          "destination": {"type": "string", "minLength": 3, "maxLength": 3},
                                          "passengers": rng("integer", 1, 9), "cabin": enum("economy", "business")},
                                         ["origin", "destination", "passengers"]),
                    "Book 2 economy seats from SFO to JFK."),
    "send_email": ("Send an email", obj({"to": arr({"type": "string", "format": "email"}, 1, 5), "subject": S,
                                         "body": S, "urgent": B}, ["to", "subject", "body"]),
                   "Email bob@example.com that the meeting moved to 3pm."),
    "create_event": ("Create a calendar event", obj({"title": S, "date": {"type": "string", "format": "date"},
                                                     "duration_minutes": rng("integer", 5, 480),
                                                     "attendees": arr(S, 0, 10)}, ["title", "date"]),
                     "Put a 30 minute standup on 2026-12-02."),
    "search_products": ("Search a shop", obj({"query": S, "max_price": rng("number", 0, 10000),
                                              "sort": enum("price", "rating", "newest"), "in_stock": B}, ["query"]),
                        "Find running shoes under 120 dollars."),
    "convert_currency": ("Convert money", obj({"amount": {"type": "number", "exclusiveMinimum": 0},
                                               "from": enum("USD", "EUR", "GBP", "JPY"),
                                               "to": enum("USD", "EUR", "GBP", "JPY")}),
                         "Convert 50 euros to dollars."),
    "get_stock_price": ("A stock's price", obj({"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}}),
                        "What is Apple's stock price?"),
    "translate": ("Translate text", obj({"text": S, "target": enum("en", "fr", "de", "es", "ja"),
                                         "formal": B}, ["text", "target"]),
                  "Translate 'good morning' to French."),
    "create_user": ("Create an account", obj({"user": obj({"name": S, "age": rng("integer", 13, 120),
                                                           "address": obj({"street": S, "city": S,
                                                                           "zip": {"type": "string",
                                                                                   "pattern": "^[0-9]{5}$"}},
                                                                          ["city"])}, ["name"]),
                                              "role": enum("admin", "member", "guest")}, ["user", "role"]),
                    "Create a member account for Ana, 34, living in Boston."),
    "order_pizza": ("Order a pizza", obj({"size": enum("small", "medium", "large"),
                                          "toppings": arr(enum("cheese", "ham", "mushroom", "olive", "pepper"), 0, 5),
                                          "quantity": rng("integer", 1, 10)}, ["size", "quantity"]),
                    "Order one large pizza with mushroom and olive."),
    "set_alarm": ("Set an alarm", obj({"hour": rng("integer", 0, 23), "minute": rng("integer", 0, 59),
                                       "repeat": arr(enum("mon", "tue", "wed", "thu", "fri", "sat", "sun"), 0, 7)},
                                      ["hour", "minute"]),
                  "Wake me at 6:45 on weekdays."),
    "rate_movie": ("Rate a movie", obj({"title": S, "stars": rng("number", 0, 5), "review": S}, ["title", "stars"]),
                   "Give Inception 4.5 stars."),
    "get_directions": ("Directions between places", obj({"from": S, "to": S,
                                                         "mode": enum("driving", "walking", "transit", "cycling"),
                                                         "avoid": arr(enum("tolls", "highways", "ferries"))},
                                                        ["from", "to"]),
                       "How do I walk from the Louvre to the Eiffel Tower?"),
    "log_workout": ("Log a workout", obj({"activity": enum("run", "swim", "bike", "lift"),
                                          "minutes": rng("integer", 1, 600), "distance_km": rng("number", 0, 500),
                                          "heart_rate": obj({"avg": rng("integer", 30, 220),
                                                             "max": rng("integer", 30, 220)}, [])},
                                         ["activity", "minutes"]),
                    "I ran 5 km in 28 minutes."),
    "create_invoice": ("Create an invoice", obj({"customer": S, "items": arr(obj({"description": S,
                                                                                 "qty": rng("integer", 1, 1000),
                                                                                 "unit_price": rng("number", 0, 1e6)}),
                                                                             1, 20),
                                                 "currency": enum("USD", "EUR"), "due_days": rng("integer", 0, 120)},
                                                ["customer", "items"]),
                       "Invoice Acme for 3 widgets at 9.99 USD each."),
    "query_database": ("Run a read-only query", obj({"table": enum("users", "orders", "products"),
                                                     "filters": arr(obj({"field": S, "op": enum("=", "<", ">", "!="),
                                                                         "value": {"type": ["string", "number"]}})),
                                                     "limit": rng("integer", 1, 1000)}, ["table"]),
                       "Show the orders over 100 dollars, at most 10."),
    "resize_image": ("Resize an image", obj({"url": S, "width": rng("integer", 1, 8192), "height": rng("integer", 1, 8192),
                                             "keep_aspect": B, "format": enum("png", "jpeg", "webp")},
                                            ["url", "width"]),
                     "Make https://x.io/cat.png 800 pixels wide."),
    "schedule_meeting": ("Find a meeting slot", obj({"participants": arr(S, 2, 8),
                                                     "length_minutes": {"enum": [15, 30, 45, 60]},
                                                     "window": obj({"start": {"type": "string", "format": "date"},
                                                                    "end": {"type": "string", "format": "date"}})},
                                                    ["participants", "length_minutes"]),
                         "Find 30 minutes for Ann and Raj next week."),
    "update_settings": ("Change app settings", obj({"theme": enum("light", "dark", "system"),
                                                    "notifications": obj({"email": B, "push": B, "sms": B}, []),
                                                    "font_scale": rng("number", 0.5, 2)}, []),
                        "Switch to dark mode and turn off push notifications."),
    "get_news": ("Latest headlines", obj({"topic": enum("world", "tech", "sports", "science", "business"),
                                          "count": rng("integer", 1, 20), "language": S}, ["topic"]),
                 "Give me 5 tech headlines."),
    "calculate_mortgage": ("Monthly mortgage payment", obj({"principal": rng("number", 1000, 1e8),
                                                            "annual_rate_percent": rng("number", 0, 25),
                                                            "years": {"enum": [10, 15, 20, 30]}}),
                           "Monthly payment on 300000 at 6.5% for 30 years?"),
    "add_todo": ("Add a to-do item", obj({"task": {"type": "string", "minLength": 1, "maxLength": 120},
                                          "priority": rng("integer", 1, 5), "tags": arr(S, 0, 5), "done": B},
                                         ["task"]),
                 "Remind me to buy milk, priority 2."),
    "play_music": ("Play music", obj({"artist": S, "song": S, "shuffle": B,
                                      "volume": rng("integer", 0, 100)}, []),
                   "Play something by Miles Davis at volume 40."),
    "track_package": ("Track a parcel", obj({"carrier": enum("ups", "fedex", "dhl", "usps"),
                                             "tracking_number": {"type": "string", "pattern": "^[A-Z0-9]{8,20}$"}}),
                      "Where is my UPS package 1Z999AA10123456784?"),
    "reserve_table": ("Reserve a restaurant table", obj({"restaurant": S, "party_size": rng("integer", 1, 20),
                                                         "time": {"type": "string", "format": "time"},
                                                         "preferences": obj({"outdoor": B,
                                                                             "diet": arr(enum("vegan", "vegetarian",
                                                                                              "gluten_free"))}, [])},
                                                        ["restaurant", "party_size", "time"]),
                      "Table for 4 at Chez Marie at 19:30, outdoors."),
    "analyze_sentiment": ("Sentiment of a text", obj({"text": S, "granularity": enum("document", "sentence")},
                                                     ["text"]),
                          "Is 'I love this phone' positive?"),
    "generate_password": ("Make a password", obj({"length": rng("integer", 8, 64), "symbols": B, "digits": B},
                                                 ["length"]),
                          "Generate a 16 character password with symbols."),
    "compare_prices": ("Compare a product across shops", obj({"product": S,
                                                              "shops": arr(enum("amazon", "ebay", "walmart", "target"),
                                                                           1, 4)}),
                       "Compare AirPods prices on Amazon and Walmart."),
    "plot_points": ("Plot points", obj({"points": arr(obj({"x": N, "y": N}), 1, 10), "title": S,
                                        "kind": enum("line", "scatter", "bar")}, ["points"]),
                    "Plot (1,2), (2,4) and (3,9) as a line."),
    "set_reminder": ("Set a reminder", obj({"message": S, "in": obj({"amount": rng("integer", 1, 1000),
                                                                     "unit": enum("minutes", "hours", "days")})}),
                     "Remind me to stretch in 45 minutes."),
}


def tool(name: str) -> dict:
    description, parameters, _ = FUNCTIONS[name]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters,
                                             "strict": True}}


def request(name: str) -> str:
    return FUNCTIONS[name][2]
