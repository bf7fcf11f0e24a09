// The Vercel AI SDK's default OpenAI provider, `createOpenAI({ baseURL })(model)`, which speaks the
// Responses API and leaves `store` to OpenAI's default (true): from its second request on it
// refers to earlier output with `item_reference` items. Usage:
//   node ai_sdk_responses.cjs BASE_URL MODEL WORD
// Runs a 3-turn chat, then a tool loop, and prints what came back as one JSON line. Loaded with
// NODE_PATH pointing at the project-local npm prefix (scripts/install-test-clients.sh).
const { createOpenAI } = require("@ai-sdk/openai");
const { generateText, stepCountIs, tool } = require("ai");
const { z } = require("zod");

const [baseURL, modelName, word] = process.argv.slice(2);

function weatherCall(city) {
  return (
    "Call the tool. <｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n" +
    `<｜DSML｜ parameter name="city" string="true">${city}</｜DSML｜ parameter>\n` +
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
  );
}

async function main() {
  const model = createOpenAI({ baseURL, apiKey: "dummy-key" })(modelName);
  const chat = [];
  const messages = [];
  for (const turn of ["one", "two", "three"]) {
    messages.push({ role: "user", content: `Turn ${turn} ${word}` });
    const result = await generateText({ model, messages, maxOutputTokens: 256 });
    chat.push(result.text);
    messages.push(...result.response.messages);
  }
  const calls = [];
  const looped = await generateText({
    model,
    prompt: weatherCall(word),
    maxOutputTokens: 256,
    stopWhen: stepCountIs(4),
    tools: {
      get_weather: tool({
        description: "Current weather of a city",
        inputSchema: z.object({ city: z.string() }),
        execute: async ({ city }) => {
          calls.push(city);
          return `sunny in ${city}`;
        },
      }),
    },
  });
  const steps = looped.steps.map((step) => step.finishReason);
  console.log(JSON.stringify({ chat, calls, steps, toolLoopText: looped.text }));
}

main().catch((error) => {
  console.error(error && error.stack ? error.stack : String(error));
  if (error && error.responseBody) console.error(error.responseBody);
  process.exit(1);
});
