//! llmserve-router: the OpenAI protocol crate of llmserve.
//!
//! "Router" here means the protocol layer, not a load balancer. This crate owns everything
//! between the bytes a client sends and the bytes it receives, except running the model:
//! request types and validation (`protocol`), the one error type (`error`), tokenization
//! (`tokenizer`), chat templates (`template`), incremental detokenization with stop strings
//! (`detokenizer`) and response/SSE building (`response`). It knows no PyO3 and no HTTP
//! server; `cargo test` exercises all of it.

pub mod bounded;
pub mod chat_store;
pub mod content_format;
pub mod conversation_store;
pub mod detokenizer;
pub mod engine_limits;
pub mod error;
pub mod fim;
pub mod item_log;
pub mod json_guard;
pub mod lora;
pub mod prediction;
pub mod protocol;
pub mod reasoning;
pub mod repetition;
pub mod response;
pub mod response_store;
pub mod router;
pub mod structured;
pub mod template;
pub mod tokenizer;
pub mod tools;

pub use error::ApiError;
