"""deepseek-recipe glue: request preparation and output streaming per client protocol."""
