"""The API process's side of the rank processes: supervision, admission, routing, handles."""
