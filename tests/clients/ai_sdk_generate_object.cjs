// createOpenAICompatible's generateObject (tests/clients/test_ai_sdk_compatible.py).
// argv: base URL, model, prompt, supportsStructuredOutputs ("true" or "false"); prints the object.
const { generateObject } = require("ai");
const { createOpenAICompatible } = require("@ai-sdk/openai-compatible");
const { z } = require("zod");
const [baseURL, model, prompt, structured] = process.argv.slice(2);
const provider = createOpenAICompatible({
  name: "deepinfer",
  baseURL,
  apiKey: "dummy-key",
  supportsStructuredOutputs: structured === "true",
});
generateObject({
  model: provider(model),
  schema: z.object({ city: z.string() }),
  prompt,
  maxRetries: 0,
}).then(
  (result) => console.log(JSON.stringify(result.object)),
  (error) => { console.error(String(error)); process.exit(1); },
);
