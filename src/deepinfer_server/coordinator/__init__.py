"""The API process's side of the rank processes: admission, routing, handles, supervision."""
