"""Grammar constraints (Lark, regex, JSON Schema): the structured-generation issue fills this."""
