"""Services: work that outlives a request (background responses, batch lines, Responses
sessions) and the one loop over a request's tokens, which the HTTP layer (`api/`) calls."""
