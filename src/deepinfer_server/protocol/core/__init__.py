"""What every API's preparation and output share: the recipe, encoding, sampling, grammars,
images, streams and error envelopes."""
