"""Weight converters from other inference formats to `transformers` state dicts."""
