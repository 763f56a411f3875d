//! The shipped path as the bench runs it: real Envoy processes with the real filter (.wasm),
//! configured from `envoy-config/envoy.yaml` rendered by `envoy-config/render.py` (the same
//! template and renderer as the demo and the end-to-end tests), in front of the bench's
//! in-process engines and collector on loopback.
//!
//! Envoy's fallback policy is round-robin here, so a request the filter leaves undecided is
//! spread blindly: kvroute's figures cannot come from Envoy's own least-request balancing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tokio::process::{Child, Command};

/// Where the gateway's parts come from.
#[derive(Clone, Debug)]
pub struct GatewaySetup {
    /// The Envoy binary.
    pub envoy: PathBuf,
    /// The filter.
    pub wasm: PathBuf,
    /// `envoy-config/` (template and renderer).
    pub config_dir: PathBuf,
    /// Envoy worker threads.
    pub concurrency: usize,
    /// Extra top-level keys of the filter's JSON configuration.
    pub filter_config: Map<String, Value>,
    /// Rendered configs and Envoy logs.
    pub work_dir: PathBuf,
    /// The filter's feed pull (and load report) period, wall milliseconds.
    pub sync_interval_ms: u32,
    /// The filter's `collector.query_timeout_ms` (None: envoy.yaml's default). A template
    /// value, since `collector` is an object the template already writes.
    pub query_timeout_ms: Option<u32>,
}

/// Why a gateway did not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("{what} missing at {path} ({hint})")]
    Missing {
        what: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("rendering {template}: {detail}")]
    Render { template: PathBuf, detail: String },
    #[error("starting envoy {name}: {source}")]
    Spawn {
        name: String,
        source: std::io::Error,
    },
    #[error("envoy {name} exited ({status}) at start: {tail}")]
    Exited {
        name: String,
        status: String,
        tail: String,
    },
    #[error("envoy {name} not ready within {timeout:?} (log: {log})")]
    NotReady {
        name: String,
        timeout: Duration,
        log: PathBuf,
    },
}

/// One running Envoy; killed when stopped or dropped.
#[derive(Debug)]
pub struct Gateway {
    pub name: String,
    /// The kvroute listener, `http://127.0.0.1:port`.
    pub url: String,
    /// Envoy's admin interface.
    pub admin: String,
    child: Child,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// `extra` merged into `base`, objects key by key (so `{"load":{"fleet":false}}` keeps the
/// other `load` keys a user passed).
pub fn merge(base: &mut Map<String, Value>, extra: &Map<String, Value>) {
    for (k, v) in extra {
        match (base.get_mut(k), v) {
            (Some(Value::Object(b)), Value::Object(e)) => merge(b, e),
            _ => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

/// The `FILTER_EXTRA` template value: `, "k": v` per key.
pub fn filter_extra(keys: &Map<String, Value>) -> String {
    keys.iter()
        .map(|(k, v)| format!(", {}: {}", json!(k), v))
        .collect()
}

/// envoy.yaml's `ENGINE_LB_ENDPOINTS`: a JSON (= YAML flow) list of loopback endpoints.
pub fn lb_endpoints(addrs: &[String]) -> String {
    let eps: Vec<Value> = addrs
        .iter()
        .map(|a| {
            let (host, port) = a.rsplit_once(':').unwrap_or((a.as_str(), "0"));
            json!({"endpoint": {"address": {"socket_address": {
                "address": host, "port_value": port.parse::<u16>().unwrap_or(0)}}}})
        })
        .collect();
    Value::Array(eps).to_string()
}

impl Gateway {
    /// Renders a config for `engines` (`ip:port`) and `collector` (`ip:port`) with `setup`'s
    /// filter keys plus `filter_keys`, starts Envoy and waits until a request goes through.
    ///
    /// # Errors
    /// Missing binary or filter, a template that does not render, or Envoy not ready in 60 s.
    pub async fn start(
        setup: &GatewaySetup,
        name: &str,
        engines: &[String],
        collector: &str,
        filter_keys: &Map<String, Value>,
        model: &str,
    ) -> Result<Gateway, GatewayError> {
        for (what, path, hint) in [
            (
                "envoy",
                &setup.envoy,
                "run envoy-config/install-envoy.sh or pass --envoy",
            ),
            (
                "filter wasm",
                &setup.wasm,
                "run `make wasm` or set KVROUTE_WASM",
            ),
        ] {
            if !path.exists() {
                return Err(GatewayError::Missing {
                    what,
                    path: path.clone(),
                    hint,
                });
            }
        }
        let _ = std::fs::create_dir_all(&setup.work_dir);
        let mut keys = setup.filter_config.clone();
        merge(&mut keys, filter_keys);
        let (listen, admin) = (free_port(), free_port());
        let (coll_host, coll_port) = collector.rsplit_once(':').unwrap_or(("127.0.0.1", "0"));
        let values: Vec<(String, String)> = vec![
            ("ADMIN_PORT".into(), admin.to_string()),
            ("LISTEN_PORT".into(), listen.to_string()),
            ("BASELINE_PORT".into(), free_port().to_string()),
            ("COLLECTOR_HOST".into(), coll_host.into()),
            ("COLLECTOR_PORT".into(), coll_port.into()),
            ("WASM_PATH".into(), setup.wasm.display().to_string()),
            ("ENGINE_LB_ENDPOINTS".into(), lb_endpoints(engines)),
            ("FALLBACK_LB".into(), "round_robin".into()),
            ("FALLBACK_LB_TYPE".into(), "RoundRobin".into()),
            ("FILTER_EXTRA".into(), filter_extra(&keys)),
            (
                "SYNC_INTERVAL_MS".into(),
                setup.sync_interval_ms.to_string(),
            ),
        ];
        let mut values = values;
        if let Some(t) = setup.query_timeout_ms {
            values.push(("QUERY_TIMEOUT_MS".into(), t.to_string()));
        }
        let config = setup.work_dir.join(format!("envoy-{name}.yaml"));
        render(&setup.config_dir, &config, &values).await?;
        let log_path = setup.work_dir.join(format!("envoy-{name}.log"));
        let log = std::fs::File::create(&log_path).map_err(|source| GatewayError::Spawn {
            name: name.into(),
            source,
        })?;
        let log2 = log.try_clone().map_err(|source| GatewayError::Spawn {
            name: name.into(),
            source,
        })?;
        let child = Command::new(&setup.envoy)
            .arg("-c")
            .arg(&config)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                &setup.concurrency.to_string(),
                "--log-level",
                "warn",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| GatewayError::Spawn {
                name: name.into(),
                source,
            })?;
        let mut gw = Gateway {
            name: name.into(),
            url: format!("http://127.0.0.1:{listen}"),
            admin: format!("http://127.0.0.1:{admin}"),
            child,
        };
        let client = reqwest::Client::new();
        let timeout = Duration::from_secs(60);
        let deadline = Instant::now() + timeout;
        // Ready: a completion goes through Envoy to an engine (the filter's VMs are up).
        while Instant::now() < deadline {
            if let Ok(Some(status)) = gw.child.try_wait() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(3).collect();
                return Err(GatewayError::Exited {
                    name: name.into(),
                    status: status.to_string(),
                    tail: tail.into_iter().rev().collect::<Vec<_>>().join(" / "),
                });
            }
            let probe = client
                .post(format!("{}/v1/completions", gw.url))
                .timeout(Duration::from_secs(5))
                .json(&json!({"model": model, "prompt": [1, 2, 3], "max_tokens": 1}))
                .send()
                .await;
            if matches!(probe, Ok(ref r) if r.status().is_success()) {
                // One more feed sync so the filter knows the worker table before the trace.
                tokio::time::sleep(Duration::from_millis(500)).await;
                return Ok(gw);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        gw.stop().await;
        Err(GatewayError::NotReady {
            name: name.into(),
            timeout,
            log: log_path,
        })
    }

    /// The filter's counters (`kvroute.*` stats), summed over Envoy's stat names.
    pub async fn filter_stats(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        let Ok(r) = reqwest::get(format!("{}/stats?filter=kvroute", self.admin)).await else {
            return out;
        };
        let text = r.text().await.unwrap_or_default();
        for line in text.lines() {
            let Some((k, v)) = line.split_once(": ") else {
                continue;
            };
            let Ok(v) = v.trim().parse::<u64>() else {
                continue;
            };
            // The listener's and the collector cluster's own stats share the name `kvroute`.
            if k.starts_with("http.") || k.starts_with("cluster.") || k.starts_with("listener.") {
                continue;
            }
            // `wasmcustom.kvroute.requests.routed` etc.: keep the filter's own part.
            let Some(i) = k.find("kvroute.") else {
                continue;
            };
            *out.entry(k[i..].to_string()).or_insert(0) += v;
        }
        out
    }

    /// Stops Envoy and waits for it.
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

async fn render(
    config_dir: &Path,
    out: &Path,
    values: &[(String, String)],
) -> Result<(), GatewayError> {
    let template = config_dir.join("envoy.yaml");
    let mut cmd = Command::new("python3");
    cmd.arg(config_dir.join("render.py"))
        .arg(&template)
        .arg(out)
        .args(values.iter().map(|(k, v)| format!("{k}={v}")))
        // Values come from the command line only: an exported LISTEN_PORT must not leak in.
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    let o = cmd.output().await.map_err(|e| GatewayError::Render {
        template: template.clone(),
        detail: e.to_string(),
    })?;
    if !o.status.success() {
        return Err(GatewayError::Render {
            template,
            detail: String::from_utf8_lossy(&o.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// The Envoy of `envoy-config/install-envoy.sh` (which installs it on first use).
///
/// # Errors
/// The script failed or printed nothing.
pub async fn installed_envoy(config_dir: &Path) -> anyhow::Result<PathBuf> {
    let o = Command::new("bash")
        .arg(config_dir.join("install-envoy.sh"))
        .stderr(Stdio::inherit())
        .output()
        .await?;
    anyhow::ensure!(o.status.success(), "install-envoy.sh failed");
    let path = String::from_utf8_lossy(&o.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string();
    anyhow::ensure!(!path.is_empty(), "install-envoy.sh printed no path");
    Ok(PathBuf::from(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_keeps_sibling_keys_and_filter_extra_is_json() {
        let mut base: Map<String, Value> =
            serde_json::from_str(r#"{"load": {"ttl_ms": 100}, "route": {"cold": "decide"}}"#)
                .unwrap();
        let extra: Map<String, Value> =
            serde_json::from_str(r#"{"load": {"fleet": false}}"#).unwrap();
        merge(&mut base, &extra);
        assert_eq!(base["load"], json!({"ttl_ms": 100, "fleet": false}));
        let text = format!("{{\"a\": 1{}}}", filter_extra(&base));
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["route"]["cold"], "decide");
        assert_eq!(filter_extra(&Map::new()), "");
    }

    #[tokio::test]
    async fn a_missing_filter_is_reported_not_started() {
        let setup = GatewaySetup {
            envoy: PathBuf::from("/bin/sh"),
            wasm: PathBuf::from("/nonexistent/kvroute_filter.wasm"),
            config_dir: PathBuf::from("../envoy-config"),
            concurrency: 1,
            filter_config: Map::new(),
            work_dir: std::env::temp_dir(),
            query_timeout_ms: None,
            sync_interval_ms: 100,
        };
        let e = Gateway::start(&setup, "t", &[], "127.0.0.1:1", &Map::new(), "m")
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                GatewayError::Missing {
                    what: "filter wasm",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[tokio::test]
    async fn the_shipped_template_renders_the_bench_values() {
        let out =
            std::env::temp_dir().join(format!("kvroute-bench-render-{}.yaml", std::process::id()));
        let extra: Map<String, Value> =
            serde_json::from_str(r#"{"load": {"fleet": false}}"#).unwrap();
        let values: Vec<(String, String)> = [
            ("ADMIN_PORT", "1"),
            ("LISTEN_PORT", "2"),
            ("BASELINE_PORT", "3"),
            ("COLLECTOR_PORT", "4"),
            ("WASM_PATH", "/x.wasm"),
            ("FALLBACK_LB", "round_robin"),
            ("FALLBACK_LB_TYPE", "RoundRobin"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .chain([
            (
                "ENGINE_LB_ENDPOINTS".to_string(),
                lb_endpoints(&["127.0.0.1:8001".into()]),
            ),
            ("FILTER_EXTRA".to_string(), filter_extra(&extra)),
        ])
        .collect();
        render(Path::new("../envoy-config"), &out, &values)
            .await
            .unwrap();
        let text = std::fs::read_to_string(&out).unwrap();
        let _ = std::fs::remove_file(&out);
        assert!(
            text.contains(r#""x-gateway-destination-endpoint", "load": {"fleet":false}"#),
            "{text}"
        );
        assert!(text.contains("load_balancing_policies.round_robin.v3.RoundRobin"));
        assert!(!text.contains("least_request.v3"));
    }

    #[test]
    fn lb_endpoints_lists_every_address() {
        let v: Value = serde_json::from_str(&lb_endpoints(&[
            "127.0.0.1:8001".into(),
            "127.0.0.1:9".into(),
        ]))
        .unwrap();
        assert_eq!(
            v[1]["endpoint"]["address"]["socket_address"]["port_value"],
            9
        );
        assert_eq!(v.as_array().unwrap().len(), 2);
    }
}
