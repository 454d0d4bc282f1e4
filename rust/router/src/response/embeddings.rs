//! The `/v1/embeddings` body: each input's pooled hidden states, summed as the engine hands
//! them over (one row per listed position, in any number of steps), then averaged,
//! shortened to `dimensions`, L2-normalized and written as floats or as base64 of their
//! little-endian f32 bytes (what the official SDK asks for and decodes). `/score` and
//! `/rerank` answer with the cosine similarities of those embeddings instead (vLLM's bodies).

use base64::Engine as _;
use serde::Serialize;

use crate::protocol::embeddings::EmbeddingPlan;
use crate::protocol::score::Scoring;

/// One request's embeddings in the making.
pub(crate) struct Embeddings {
    plan: EmbeddingPlan,
    /// Per input: the sum of its pooled rows (f64, so a mean over a long prompt loses
    /// nothing to summation order) and how many there were.
    sums: Vec<(Vec<f64>, u32)>,
}

#[derive(Serialize)]
struct Body<'a> {
    object: &'static str,
    data: Vec<Item>,
    model: &'a str,
    usage: Usage,
}

#[derive(Serialize)]
struct Item {
    object: &'static str,
    embedding: Vector,
    index: usize,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Floats(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct ScoreBody<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    data: Vec<ScoreItem>,
    usage: ScoreUsage,
}

#[derive(Serialize)]
struct ScoreItem {
    index: usize,
    object: &'static str,
    score: f64,
}

#[derive(Serialize)]
struct ScoreUsage {
    prompt_tokens: u64,
    total_tokens: u64,
    completion_tokens: u64,
}

#[derive(Serialize)]
struct RerankBody<'a> {
    id: &'a str,
    model: &'a str,
    usage: RerankUsage,
    results: Vec<RerankItem<'a>>,
}

#[derive(Serialize)]
struct RerankItem<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    document: Option<RerankDocument<'a>>,
    relevance_score: f64,
}

#[derive(Serialize)]
struct RerankDocument<'a> {
    text: &'a str,
}

#[derive(Serialize)]
struct RerankUsage {
    prompt_tokens: u64,
    total_tokens: u64,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    total_tokens: u64,
}

impl Embeddings {
    pub(crate) fn new(plan: EmbeddingPlan, inputs: usize) -> Self {
        Self { plan, sums: vec![(Vec::new(), 0); inputs] }
    }

    /// One pooled row (a final hidden state) of input `input`.
    pub(crate) fn add(&mut self, input: usize, row: &[f32]) {
        let Some((sum, count)) = self.sums.get_mut(input) else { return };
        if sum.is_empty() {
            sum.resize(row.len(), 0.0);
        }
        for (s, &x) in sum.iter_mut().zip(row) {
            *s += f64::from(x);
        }
        *count += 1;
    }

    /// Input `input`'s embedding: the mean of its rows (the one row, under last-token
    /// pooling), its first `dimensions` components, normalized when asked.
    fn vector(&self, input: usize) -> Vec<f32> {
        self.vector_f64(input).into_iter().map(|x| x as f32).collect()
    }

    fn vector_f64(&self, input: usize) -> Vec<f64> {
        let (sum, count) = &self.sums[input];
        let keep = self.plan.dimensions.unwrap_or(sum.len()).min(sum.len());
        let mut v: Vec<f64> = sum[..keep].iter().map(|s| s / f64::from((*count).max(1))).collect();
        if self.plan.normalize {
            // (as torch's F.normalize: a zero vector stays zero)
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
            v.iter_mut().for_each(|x| *x /= norm);
        }
        v
    }

    /// The whole response body. `prompt_tokens`: the inputs' tokens, summed.
    pub(crate) fn body(&self, id: &str, created: u64, model: &str, prompt_tokens: u64) -> Vec<u8> {
        match self.plan.scoring.as_deref() {
            None => self.embeddings_body(model, prompt_tokens),
            Some(Scoring::Pairs(pairs)) => {
                let data = pairs
                    .iter()
                    .enumerate()
                    .map(|(index, &(a, b))| ScoreItem { index, object: "score", score: self.cosine(a, b) })
                    .collect();
                let usage = ScoreUsage { prompt_tokens, total_tokens: prompt_tokens, completion_tokens: 0 };
                let body = ScoreBody { id, object: "list", created, model, data, usage };
                serde_json::to_vec(&body).expect("bodies serialize")
            }
            Some(Scoring::Rerank { top_n, documents }) => {
                let mut results: Vec<RerankItem> = (1..self.sums.len())
                    .map(|input| RerankItem {
                        index: input - 1,
                        document: documents.as_ref().map(|d| RerankDocument { text: &d[input - 1] }),
                        relevance_score: self.cosine(0, input),
                    })
                    .collect();
                // best first; equal scores keep the documents' order
                results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
                if *top_n > 0 {
                    results.truncate(*top_n);
                }
                let usage = RerankUsage { prompt_tokens, total_tokens: prompt_tokens };
                serde_json::to_vec(&RerankBody { id, model, usage, results }).expect("bodies serialize")
            }
        }
    }

    /// The cosine similarity of inputs `a` and `b`'s embeddings (as torch's
    /// `cosine_similarity`: the product of the norms is kept from 0 by 1e-8).
    fn cosine(&self, a: usize, b: usize) -> f64 {
        let (x, y) = (self.vector_f64(a), self.vector_f64(b));
        let dot: f64 = x.iter().zip(&y).map(|(p, q)| p * q).sum();
        let norm = |v: &[f64]| v.iter().map(|p| p * p).sum::<f64>().sqrt();
        dot / (norm(&x) * norm(&y)).max(1e-8)
    }

    fn embeddings_body(&self, model: &str, prompt_tokens: u64) -> Vec<u8> {
        let data = (0..self.sums.len())
            .map(|i| {
                let v = self.vector(i);
                let embedding = if self.plan.base64 {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    Vector::Floats(v)
                };
                Item { object: "embedding", embedding, index: i }
            })
            .collect();
        let usage = Usage { prompt_tokens, total_tokens: prompt_tokens };
        serde_json::to_vec(&Body { object: "list", data, model, usage }).expect("bodies serialize")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::embeddings::Pooling;

    fn plan(normalize: bool, dimensions: Option<usize>, base64: bool) -> EmbeddingPlan {
        EmbeddingPlan { pooling: Pooling::Mean, normalize, dimensions, base64, scoring: None }
    }

    fn data(body: &[u8]) -> Vec<serde_json::Value> {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        v["data"].as_array().unwrap().clone()
    }

    #[test]
    fn rows_are_averaged_then_normalized_per_input() {
        let mut e = Embeddings::new(plan(true, None, false), 2);
        e.add(0, &[1.0, 2.0]);
        e.add(0, &[3.0, 6.0]);
        e.add(1, &[0.0, -5.0]);
        let d = data(&e.body("id", 1, "m", 9));
        let v0: Vec<f64> = d[0]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let n = (2f64 * 2.0 + 4.0 * 4.0).sqrt();
        assert!((v0[0] - 2.0 / n).abs() < 1e-6 && (v0[1] - 4.0 / n).abs() < 1e-6);
        assert_eq!(d[1]["embedding"], serde_json::json!([0.0, -1.0]));
        assert_eq!(d[1]["index"], 1);
    }

    #[test]
    fn dimensions_cut_before_normalizing_and_raw_means_stay_raw() {
        let mut e = Embeddings::new(plan(true, Some(1), false), 1);
        e.add(0, &[-3.0, 4.0]);
        assert_eq!(data(&e.body("id", 1, "m", 1))[0]["embedding"], serde_json::json!([-1.0]));
        let mut e = Embeddings::new(plan(false, None, false), 1);
        e.add(0, &[-3.0, 4.0]);
        e.add(0, &[-1.0, 0.0]);
        assert_eq!(data(&e.body("id", 1, "m", 1))[0]["embedding"], serde_json::json!([-2.0, 2.0]));
    }

    #[test]
    fn base64_is_little_endian_f32_and_usage_counts_input_tokens() {
        let mut e = Embeddings::new(plan(false, None, true), 1);
        e.add(0, &[1.5, -2.0]);
        let body: serde_json::Value = serde_json::from_slice(&e.body("id", 1, "m", 7)).unwrap();
        let text = body["data"][0]["embedding"].as_str().unwrap();
        let bytes = base64::engine::general_purpose::STANDARD.decode(text).unwrap();
        let back: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(back, vec![1.5, -2.0]);
        assert_eq!(body["usage"], serde_json::json!({"prompt_tokens": 7, "total_tokens": 7}));
        assert_eq!((body["object"].as_str(), body["model"].as_str()), (Some("list"), Some("m")));
        assert_eq!(body["data"][0]["object"], "embedding");
    }
    fn scoring(scoring: Scoring, rows: &[&[f32]]) -> serde_json::Value {
        let plan = EmbeddingPlan {
            pooling: Pooling::Last,
            normalize: false,
            dimensions: None,
            base64: false,
            scoring: Some(std::sync::Arc::new(scoring)),
        };
        let mut e = Embeddings::new(plan, rows.len());
        for (i, row) in rows.iter().enumerate() {
            e.add(i, row);
        }
        serde_json::from_slice(&e.body("score-1", 5, "m", 12)).unwrap()
    }

    #[test]
    fn scores_are_the_cosines_of_each_pair_in_order() {
        let rows: [&[f32]; 4] = [&[1.0, 0.0], &[3.0, 4.0], &[0.0, -2.0], &[0.0, 0.0]];
        let body = scoring(Scoring::Pairs(vec![(0, 1), (0, 2), (1, 1), (0, 3)]), &rows);
        let scores: Vec<f64> = body["data"].as_array().unwrap().iter().map(|d| d["score"].as_f64().unwrap()).collect();
        assert_eq!(scores.len(), 4);
        for (got, want) in scores.iter().zip([0.6, 0.0, 1.0, 0.0]) {
            assert!((got - want).abs() < 1e-12, "{scores:?}");
        }
        assert_eq!(body["data"][1]["index"], 1);
        assert_eq!(body["data"][1]["object"], "score");
        assert_eq!(
            (body["id"].as_str(), body["object"].as_str(), body["created"].as_u64()),
            (Some("score-1"), Some("list"), Some(5))
        );
        assert_eq!(body["usage"], serde_json::json!({"prompt_tokens": 12, "total_tokens": 12, "completion_tokens": 0}));
    }

    #[test]
    fn rerank_ranks_documents_best_first_and_keeps_top_n() {
        // the query, then documents 0..3: cosines 0.6, -1, 1, 0.6
        let rows: [&[f32]; 5] = [&[1.0, 0.0], &[3.0, 4.0], &[-2.0, 0.0], &[5.0, 0.0], &[6.0, 8.0]];
        let docs: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let body = scoring(Scoring::Rerank { top_n: 0, documents: Some(docs.clone()) }, &rows);
        let order: Vec<u64> =
            body["results"].as_array().unwrap().iter().map(|r| r["index"].as_u64().unwrap()).collect();
        assert_eq!(order, vec![2, 0, 3, 1], "best first, ties in the documents' order");
        assert_eq!(body["results"][0]["document"], serde_json::json!({"text": "c"}));
        assert!((body["results"][3]["relevance_score"].as_f64().unwrap() + 1.0).abs() < 1e-12);
        assert_eq!(body["usage"], serde_json::json!({"prompt_tokens": 12, "total_tokens": 12}));
        assert_eq!(body["model"], "m");
        let body = scoring(Scoring::Rerank { top_n: 2, documents: None }, &rows);
        let results = body["results"].as_array().unwrap();
        assert_eq!(results.len(), 2);
        assert!(results.iter().all(|r| r.get("document").is_none()));
    }
}
