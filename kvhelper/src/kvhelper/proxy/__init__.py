"""The XpYd proxy: one OpenAI-compatible entry point that runs each request's prefill on a
prefill instance and its decode on a decode instance, handing the KV over through
`kv_transfer_params`."""
