//! The Python mirror of the router's `ApiError` (imported here as `RouterError`): one
//! exception class per HTTP status family under `_core.ApiError`, each instance carrying
//! `status`, `type`, `code`, `param`, `message`, `retry_after`, the ready JSON `body` and its
//! SSE frame `sse`, so the server never rebuilds an error body itself.

use llmserve_router::ApiError as RouterError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyTuple, PyType};

create_exception!(llmserve._core, ApiError, PyException, "An error in the OpenAI error shape.");
create_exception!(llmserve._core, AuthenticationError, ApiError, "401: missing or wrong API key.");
create_exception!(llmserve._core, NotFoundError, ApiError, "404: unknown model or resource.");
create_exception!(llmserve._core, MethodNotAllowedError, ApiError, "405: the route does not serve this method.");
create_exception!(llmserve._core, PayloadTooLargeError, ApiError, "413: request body too large.");
create_exception!(llmserve._core, InternalServerError, ApiError, "500: the engine failed.");
create_exception!(llmserve._core, ServiceUnavailableError, ApiError, "503: try again later.");

static BAD_REQUEST_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// 400: an `ApiError` that is also a `ValueError`, as vLLM's offline API raises bad params
/// and too-long prompts, so code written for it (`except ValueError`) catches ours. Two bases,
/// which `create_exception!` cannot give: made by `type()` once.
fn bad_request_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let ty = BAD_REQUEST_ERROR.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let bases = PyTuple::new(py, [py.get_type::<ApiError>(), py.get_type::<PyValueError>()])?;
        let namespace = PyDict::new(py);
        namespace.set_item("__module__", "llmserve._core")?;
        namespace.set_item("__doc__", "400: the request is invalid.")?;
        let made = py.get_type::<PyType>().call1(("BadRequestError", bases, namespace))?;
        Ok(made.cast_into::<PyType>()?.unbind())
    })?;
    Ok(ty.bind(py))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ApiError", py.get_type::<ApiError>())?;
    m.add("BadRequestError", bad_request_error(py)?)?;
    m.add("AuthenticationError", py.get_type::<AuthenticationError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("MethodNotAllowedError", py.get_type::<MethodNotAllowedError>())?;
    m.add("PayloadTooLargeError", py.get_type::<PayloadTooLargeError>())?;
    m.add("InternalServerError", py.get_type::<InternalServerError>())?;
    m.add("ServiceUnavailableError", py.get_type::<ServiceUnavailableError>())?;
    Ok(())
}

/// Convert the router's error into the matching Python exception with its fields attached.
pub fn to_py(py: Python<'_>, e: &RouterError) -> PyErr {
    let msg = e.message();
    let err = match e.status() {
        400 => match bad_request_error(py) {
            Ok(ty) => PyErr::from_type(ty.clone(), msg.clone()),
            Err(e) => return e,
        },
        401 => AuthenticationError::new_err(msg.clone()),
        404 => NotFoundError::new_err(msg.clone()),
        405 => MethodNotAllowedError::new_err(msg.clone()),
        413 => PayloadTooLargeError::new_err(msg.clone()),
        503 => ServiceUnavailableError::new_err(msg.clone()),
        _ => InternalServerError::new_err(msg.clone()),
    };
    let value = err.value(py);
    let set = || -> PyResult<()> {
        value.setattr("status", e.status())?;
        value.setattr("type", e.error_type())?;
        value.setattr("code", e.code())?;
        value.setattr("param", e.param())?;
        value.setattr("message", msg.clone())?;
        value.setattr("retry_after", e.retry_after())?;
        value.setattr("body", PyBytes::new(py, &e.to_json()))?;
        value.setattr("sse", PyBytes::new(py, &e.to_sse()))?;
        value.setattr("anthropic_body", PyBytes::new(py, &e.to_anthropic_json()))?;
        value.setattr("anthropic_sse", PyBytes::new(py, &e.to_anthropic_sse()))?;
        Ok(())
    };
    if let Err(inner) = set() {
        return inner;
    }
    err
}

/// A Responses stream's `error` event for `err`, an ApiError already raised (the engine's
/// 503 when it stops with the stream open), numbered `sequence_number`: the stream's next.
#[pyfunction]
pub fn responses_error_event<'py>(err: &Bound<'py, PyAny>, sequence_number: u64) -> PyResult<Bound<'py, PyBytes>> {
    let body: Vec<u8> = err.getattr("body")?.extract()?;
    let body = serde_json::from_slice(&body)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("not an error body: {e}")))?;
    Ok(PyBytes::new(err.py(), &llmserve_router::error::responses_error_event(body, sequence_number)))
}

/// Build the router's error of a named kind from Python (the engine's 503s and 500s, the
/// server's 401/404/413), so that every body is still made here.
pub fn from_kind(
    kind: &str,
    message: String,
    param: Option<String>,
    retry_after: Option<u32>,
    limit: Option<usize>,
) -> Option<RouterError> {
    Some(match kind {
        "invalid_request" => RouterError::InvalidRequest { message, param, code: "invalid_value" },
        "unsupported_parameter" => RouterError::with_code("unsupported_parameter", param, message),
        "unsupported_media_type" => RouterError::with_code("unsupported_media_type", None, message),
        // a browser's preflight (OPTIONS) from an origin, method or header --allowed-* does not list
        "cors_refused" => RouterError::with_code("cors_refused", None, message),
        "unauthorized" => RouterError::Unauthorized { message },
        "not_found" => RouterError::NotFound { message },
        "method_not_allowed" => RouterError::MethodNotAllowed { message },
        "model_not_found" => RouterError::ModelNotFound { model: message, served: Vec::new() },
        "payload_too_large" => RouterError::PayloadTooLarge { limit: limit.unwrap_or_default() },
        // `limit`: the seconds the body was awaited
        "request_timeout" => {
            RouterError::RequestTimeout { seconds: limit.unwrap_or_default().min(u32::MAX as usize) as u32 }
        }
        "unavailable" => RouterError::Unavailable { message, retry_after },
        "internal" => RouterError::Internal { message },
        _ => return None,
    })
}
